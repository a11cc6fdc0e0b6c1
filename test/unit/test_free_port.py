"""get_free_port picks outside the kernel's ephemeral range, so no automatic bind can take it first."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from radixserve.utils import network
from radixserve.utils.network import ephemeral_port_range, get_free_port


def test_the_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ephemeral_port_range()
    for _ in range(20):
        port = get_free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    # The only pickable span is 20000-20999 (ephemeral from 21000 up); hold all but a few of it.
    monkeypatch.setattr(network, "_LOWEST_PICKED_PORT", 20000)
    held: list[socket.socket] = []
    try:
        for port in range(20000, 20997):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        busy = {s.getsockname()[1] for s in held}
        for _ in range(10):
            port = network.get_free_port(ephemeral=(21000, 65535))
            assert port not in busy
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_the_range_file_is_read_and_a_bad_one_falls_back(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(good)) == (40000, 50000)
    bad = tmp_path / "bad"
    bad.write_text("nonsense")
    assert ephemeral_port_range(str(bad)) == (32768, 60999)
    assert ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)


def test_no_room_outside_the_range_falls_back_to_the_kernels_choice() -> None:
    port = get_free_port(ephemeral=(1024, 65535))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
