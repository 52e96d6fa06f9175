"""The command line of `examples/vllm_events.py`: options out of range and endpoints ZeroMQ refuses are one line on
stderr and status 2, never a traceback or a run that makes no sense (`--num-prompts -5` matched, `--duration -1`
ran until killed). Its sockets are tested in tests/test_vllm_events_zmq.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_example(name: str = "vllm_events_cli_example") -> ModuleType:
    """examples/vllm_events.py as a module called `name` (tests/test_vllm_events_zmq.py loads it too)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "vllm_events.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs classes look their module up
    spec.loader.exec_module(module)
    return module


example = load_example()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["loopback", "--block-size", "0"], "argument --block-size: must be an integer >= 1, got '0'"),
        (["loopback", "--vram-blocks", "0"], "argument --vram-blocks: must be an integer >= 1, got '0'"),
        (["loopback", "--dram-blocks", "x"], "argument --dram-blocks: must be an integer >= 1, got 'x'"),
        (["loopback", "--num-prompts", "-5"], "argument --num-prompts: must be an integer >= 1, got '-5'"),
        (["publish", "--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
        (["publish", "--interval-s", "-1"], "argument --interval-s: must be a finite number of seconds >= 0"),
        (["publish", "--interval-s", "nan"], "argument --interval-s: must be a finite number of seconds >= 0"),
        (["subscribe", "--duration", "-1"], "argument --duration: must be a finite number of seconds >= 0"),
        (
            [
                "subscribe",
                "--report-every",
                "0",
                "--duration",
                "0.1",
                "--endpoint",
                "tcp://127.0.0.1:*",
                "--replay",
                "",
            ],
            "argument --report-every: must be a finite number of seconds > 0",
        ),
    ],
)
def test_an_option_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Each was a traceback (a ConfigError, sleep's ValueError) or was run as given: now argparse refuses it."""
    with pytest.raises(SystemExit) as caught:
        example.main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and f"vllm_events {argv[0]}: error: {message}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["subscribe", "--endpoint", "bogus", "--replay", ""],
        ["subscribe", "--endpoint", "tcp://127.0.0.1:*", "--replay", "bogus", "--duration", "0.1"],
        ["publish", "--endpoint", "bogus", "--replay", "", "--num-prompts", "1"],
    ],
)
def test_an_endpoint_zeromq_refuses_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """`--endpoint bogus` was a ZMQError traceback: now one line naming the address, status 2."""
    pytest.importorskip("zmq", reason="pyzmq (the kv-events extra) is not installed")
    pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")
    assert example.main(argv) == 2
    assert capsys.readouterr().err == "vllm_events: error: Invalid argument (addr='bogus')\n"


@pytest.mark.parametrize(
    ("argv", "option", "port"),
    [
        (
            ["subscribe", "--endpoint", "tcp://127.0.0.1:99999", "--replay", "", "--duration", "0.1"],
            "--endpoint",
            99999,
        ),
        (["subscribe", "--endpoint", "tcp://127.0.0.1:0", "--replay", "", "--duration", "0.1"], "--endpoint", 0),
        (["publish", "--endpoint", "tcp://127.0.0.1:70000", "--replay", "", "--num-prompts", "1"], "--endpoint", 70000),
        (
            ["subscribe", "--endpoint", "tcp://127.0.0.1:*", "--replay", "tcp://127.0.0.1:65536", "--duration", "0.1"],
            "--replay",
            65536,
        ),
        (["publish", "--replay", "tcp://*:99999", "--num-prompts", "1"], "--replay", 99999),
    ],
)
def test_an_endpoint_port_zeromq_would_change_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, port: int
) -> None:
    """ZeroMQ takes a port over 65535 modulo 65536 (99999 bound 34463, where a vLLM told 99999 never connects, and
    the run exited 0) and 0 as any port: refused by the rule the router's config refuses them by."""
    with pytest.raises(SystemExit) as caught:
        example.main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2, err
    assert (
        f"vllm_events {argv[0]}: error: argument {option}: " in err and f"has port {port}: must be in 1..65535" in err
    )
    assert err.count("\n") == 1 and "Traceback" not in err
