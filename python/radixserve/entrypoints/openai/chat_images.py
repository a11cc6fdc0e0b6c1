"""The images of a chat request: its `image_url` parts, in order, as the native image_data.

The chat template renders each part's placeholder where it stands (chat_tools._template_content);
the images themselves go to the TokenizerManager, which fetches URLs (multimodal/media_fetch.py)
and expands each placeholder to the image's tokens. A text-only model refuses them here, naming
the first offending field.
"""

from __future__ import annotations

from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, ImageUrlContentPart
from radixserve.managers.input_validation import InvalidRequestError


def chat_images(req: ChatCompletionRequest, refusal: str | None) -> list[str] | None:
    """The request's image URLs in prompt order (None: none); InvalidRequestError (400) when the
    model takes no images, or an image sits in a message other than the user's."""
    images: list[str] = []
    for i, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImageUrlContentPart):
                continue
            field = f"messages[{i}].content[{j}].image_url"
            if refusal is not None:
                raise InvalidRequestError(f"'{field}' is not supported: {refusal}.")
            if message.role != "user":
                raise InvalidRequestError(f"'{field}': images are accepted in user messages only.")
            images.append(part.image_url.url)
    return images or None
