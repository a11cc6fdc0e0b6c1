"""update_weights_from_disk on a server of a GGUF MoE, from another GGUF file of the same model
(model_executor/gguf_update.py): the file itself, or its conversion folder, which holds the dense
weights only (its experts stay in the file). Before this the conversion's experts were not read: the
server served the new dense weights beside the old experts, and reported success.

Each updated server must decode exactly as a server started on the new file: under --quantization
gguf (the new file's own forms, experts included, exact and on panels) and under unquant (fp32
experts read from the file). A file of another architecture is refused and the old weights kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(600)

PROMPTS = [[9, 88, 140, 23, 200, 71, 5, 301, 12], [40, 41, 42, 43, 44], [7, 300, 8]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _decode(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _engine(path: Path, **kw: object) -> Engine:
    # fp32 K/V: the weights are compared.
    return Engine(
        model_path=str(path), max_total_tokens=4096, log_level="warning", kv_cache_dtype="float32", **kw
    )


def _files(tmp_path: Path) -> tuple[Path, Path]:
    old = make_tiny_moe_gguf(tmp_path / "old.gguf", "qwen3_moe", "Q8_0", {"ffn_down_exps": "Q4_0"}, seed=0)
    new = make_tiny_moe_gguf(tmp_path / "new.gguf", "qwen3_moe", "Q8_0", {"ffn_down_exps": "Q4_0"}, seed=1)
    return old, new


def _conversion(cache: Path, stem: str) -> str:
    return str(next(p.parent for p in (cache / "gguf").glob(f"{stem}-*/config.json")))


# make test: the file (converted first) under the default expert path, and the folder under the
# two other paths; the rest are make test-all's (docs/testing.md): each differs from a make test
# case only in where the update comes from (the conversion folder or the .gguf file).
_SLOW = pytest.mark.slow
CASES = [
    pytest.param("folder", {}, id="folder-gguf", marks=_SLOW),
    pytest.param("folder", {"cpu_wq_int8_activations": True}, id="folder-gguf-panels"),
    pytest.param("folder", {"quantization": "unquant"}, id="folder-unquant"),
    pytest.param("file", {}, id="file-gguf"),
    pytest.param("file", {"cpu_wq_int8_activations": True}, id="file-gguf-panels", marks=_SLOW),
    pytest.param("file", {"quantization": "unquant"}, id="file-unquant", marks=_SLOW),
]


@pytest.mark.parametrize(("target", "flags"), CASES)
def test_update_from_another_gguf_file_decodes_as_that_file(flags, target, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))
    old, new = _files(tmp_path)
    with _engine(new, **flags) as engine:
        want = _decode(engine)
    with _engine(old, **flags) as engine:
        before = _decode(engine)
        assert before != want  # two different random models, or the test proves nothing
        path = str(new) if target == "file" else _conversion(cache, "new")
        ok, message = engine.update_weights_from_disk(model_path=path)
        assert ok, message
        assert _decode(engine) == want
        # And back: the file served now is the new one, so the old one's forms come back too.
        back = str(old) if target == "file" else _conversion(cache, "old")
        ok, message = engine.update_weights_from_disk(model_path=back)
        assert ok, message
        assert _decode(engine) == before


def test_update_from_a_file_of_another_architecture_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    old, _ = _files(tmp_path)
    other = make_tiny_moe_gguf(tmp_path / "mixtral.gguf", "mixtral", "Q8_0")
    with _engine(old) as engine:
        before = _decode(engine)
        ok, message = engine.update_weights_from_disk(model_path=str(other))
        assert not ok and "architecture" in message.lower()
        engine.flush_cache()  # the same prompts again would read their prefixes from the radix cache
        assert _decode(engine) == before
