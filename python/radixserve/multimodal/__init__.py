"""Images in: the request side (processor.py, on the tokenizer threads), the scheduler side
(inputs.py: MultimodalInputs on the request, hashed pad values, what a forward needs) and M-RoPE
positions (mrope.py). The vision towers live in models/."""
