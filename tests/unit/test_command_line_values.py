"""Values from the command line and odd endpoint strings: refused with a message, never a
traceback later."""

from __future__ import annotations

import argparse

import pytest

from engine_sidecar.sim.main import _port
from proxy.cli import _time_scale
from proxy.core.kv_config import endpoint_problem


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "fast", ""])
def test_the_demos_time_scale_is_a_finite_number_above_zero(raw: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _time_scale(raw)
    assert _time_scale("2.5") == 2.5


@pytest.mark.parametrize("raw", ["65536", "131073", "-1", "http", ""])
def test_the_simulators_port_is_a_tcp_port(raw: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _port(raw)
    assert _port("0") == 0 and _port("65535") == 65535


def test_a_kv_endpoint_port_is_ascii_digits() -> None:
    # "²" is a digit to str.isdigit() and not to int().
    assert endpoint_problem("tcp://h:²", bind=False) is not None
    assert endpoint_problem("tcp://h:5557", bind=False) is None
