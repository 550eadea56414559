"""The CLI on bad arguments and bad input: one clear line and exit code 2, never a traceback;
Ctrl-C in `generate` and `chat`; `stats` output. Against an in-process fake decode service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.cli import commands as cli
from protos.kvserve.v1 import kvstore_pb2
from tests.fake_decode import FakeServer
from tests.polling import wait_until


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def fake() -> FakeServer:
    with FakeServer() as f:
        yield f  # type: ignore[misc]


@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read --messages-file"),
    ('[{"role":', "is not valid JSON"),
    ('{"role": "user", "content": "x"}', "must hold a JSON list"),
    ('"hello"', "must hold a JSON list"),
    ('[{"role": "user"}]', "message 0 has no 'content'"),
    ('[{"role": "user", "content": 5}]', "must be strings"),
    ('["hello"]', "message 0 must be an object"),
])
def test_bad_messages_file_is_one_line_and_exit_2(
    tmp_path: Path, fake: FakeServer, capsys: pytest.CaptureFixture[str], content: str | None, match: str
) -> None:
    path = tmp_path / "messages.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run(["generate", "--messages-file", str(path), "--addr", fake.addr], capsys)
    assert code == 2 and match in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert fake.servicer.requests == []


def test_messages_file_takes_an_openai_style_body_and_stdin(
    tmp_path: Path, fake: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    code, out, err = run(["generate", "--messages-file", str(path), "--addr", fake.addr, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["text"] == "x" * 64
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(json.dumps(body["messages"])))
    code, _, err = run(["generate", "--messages-file", "-", "--addr", fake.addr, "--max-tokens", "2"], capsys)
    assert code == 0, err
    assert [m.content for r in fake.servicer.requests for m in r.prompt.messages.messages] == ["hi", "hi"]


def test_an_openai_body_sets_the_sampling_options_or_is_refused_naming_the_field(
    tmp_path: Path, fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pasted OpenAI body's max_tokens (64 came back before), temperature, stop... are honoured; one that
    asks for what kvserve does not implement is refused before anything is sent."""
    path = tmp_path / "body.json"
    path.write_text(json.dumps({"model": "gpt-4o", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                                "stop": "\n\n", "user": "u1", "stream": True, "messages": [
                                    {"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}))
    code, out, err = run(["generate", "--messages-file", str(path), "--addr", fake.addr, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["text"] == "x" * 5
    [request] = fake.servicer.requests
    s = request.sampling
    assert (s.max_tokens, round(s.temperature, 3), round(s.top_p, 3), s.seed, list(s.stop)) == (5, 0.7, 0.9, 3, ["\n\n"])
    assert [(m.role, m.content) for m in request.prompt.messages.messages] == [("system", "be brief"), ("user", "hi")]
    for body, match in [({"tools": []}, "unsupported field 'tools'"), ({"n": 3}, "n=3"),
                        ({"logprobs": True}, "logprobs"), ({"max_tokens": 0}, "max_tokens")]:
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}))
        code, _, err = run(["generate", "--messages-file", str(path), "--addr", fake.addr], capsys)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert len(fake.servicer.requests) == 1


@pytest.mark.parametrize("args", [
    ["--max-tokens", "-1"], ["--top-k", "-3"], ["--seed", "-5"], ["--timeout", "0"], ["--timeout", "-1"],
])
def test_negative_options_are_refused_by_the_parser(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    code, _, err = run(["generate", "hi", "--addr", fake.addr, *args], capsys)
    assert code == 2 and f"argument {args[0]}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("ids", ["-1", "1,4294967296"])
def test_token_ids_outside_uint32_are_one_line(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], ids: str
) -> None:
    code, _, err = run(["generate", "--token-ids", ids, "--addr", fake.addr], capsys)
    assert code == 2 and "token id must be in" in err and "Traceback" not in err, err


def test_huge_seed_is_one_line(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["generate", "hi", "--seed", str(2**64), "--addr", fake.addr], capsys)
    assert code == 2 and "seed must be in" in err, err


def test_help_documents_defaults_and_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["generate", "--help"], capsys)
    out = " ".join(out.split())
    assert code == 0 and "0 is the server's default" in out and "(default 64)" in out
    code, out, _ = run(["up", "--help"], capsys)
    out = " ".join(out.split())
    assert code == 0 and "Ctrl-C or SIGTERM stops them all" in out and "(default 50051)" in out and "(default 8000" in out
    code, out, _ = run(["stats", "--help"], capsys)
    assert code == 0 and "--metrics-base-port" in out


def test_stats_json_counts_are_numbers_and_tiers_are_named() -> None:
    reply = kvstore_pb2.StatsResponse(
        tiers=[kvstore_pb2.TierStats(tier=kvstore_pb2.TIER_HOST, blocks=3, bytes=10, capacity_bytes=100, hits=2)],
        leases=1,
    )
    d = cli.stats_dict(reply)
    assert d["tiers"] == [{"tier": "host", "blocks": 3, "bytes": 10, "capacity_bytes": 100, "hits": 2,
                           "misses": 0, "evictions": 0, "demotions": 0, "promotions": 0, "unavailable": False}]
    assert d["leases"] == 1 and d["pinned_blocks"] == 0


def test_stats_text_hides_created_and_bucket_samples_with_labels() -> None:
    samples = cli.parse_metrics(
        '# HELP x\nkvserve_decode_requests_total{outcome="ok"} 3\n'
        'kvserve_decode_requests_created{outcome="ok"} 1.7e9\n'
        'kvserve_decode_ttft_seconds_bucket{le="0.1"} 2\nkvserve_kvstore_blocks{tier="host"} 5.0\n'
        'python_gc_objects_collected_total{generation="0"} 9\n'
    )
    assert [s for s in samples if cli.shown_metric(s)] == [
        'kvserve_decode_requests_total{outcome="ok"}', 'kvserve_kvstore_blocks{tier="host"}']


def test_stats_with_an_unreachable_metrics_url_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from concurrent import futures

    import grpc

    from protos.kvserve.v1 import kvstore_pb2_grpc

    class Store(kvstore_pb2_grpc.KVStoreServicer):
        def Stats(self, request: object, context: object) -> kvstore_pb2.StatsResponse:  # noqa: N802
            return kvstore_pb2.StatsResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(Store(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for url in ["http://127.0.0.1:1/metrics", "nonsense"]:
            code, _, err = run(["stats", "--kvstore", f"127.0.0.1:{port}", "--metrics", url], capsys)
            assert code == 2 and f"cannot read metrics from {url}" in err and "Traceback" not in err, err
    finally:
        server.stop(0)


# A CLI started where SIGINT is ignored (a background job, nohup) keeps ignoring it, as Python does; the tests
# stand for a terminal's Ctrl-C, whatever the test run was started from, so the CLI's process puts Python's handler
# back before it runs. Not in a preexec_fn: that runs the at-fork hooks of this process's gRPC threads in the child,
# which can hang it before it runs anything (seen once in a full run: "the CLI never called the server").
_CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'kvserve'; runpy.run_module('kvserve.cli', run_name='__main__', alter_sys=True)")


def _cli(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CLI, *args], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
                            **kwargs)  # type: ignore[call-overload]


def _wait_for_requests(fake: FakeServer, n: int) -> None:
    wait_until(lambda: len(fake.servicer.requests) >= n, timeout_s=30, message="the CLI never called the server")
    time.sleep(0.3)  # a few tokens out


def test_ctrl_c_in_generate_cancels_quietly() -> None:
    with FakeServer(delay_s=0.05) as fake:
        proc = _cli("generate", "hi", "--max-tokens", "1000", "--addr", fake.addr)
        _wait_for_requests(fake, 1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "interrupted" in err
        assert out.startswith("x") and out.endswith("\n")
        assert fake.servicer.wait_outcomes(1) == ["cancelled"]


@pytest.mark.slow
def test_ctrl_c_in_chat_stops_the_reply_and_keeps_the_chat() -> None:
    with FakeServer(delay_s=0.01) as fake:
        proc = _cli("chat", "--max-tokens", "300", "--addr", fake.addr)
        assert proc.stdin is not None
        proc.stdin.write("first\n")
        proc.stdin.flush()
        _wait_for_requests(fake, 1)
        proc.send_signal(signal.SIGINT)
        assert fake.servicer.wait_outcomes(1) == ["cancelled"]
        try:
            out, err = proc.communicate("second\n", timeout=60)
        except subprocess.TimeoutExpired:  # seen once in a full run, not in 1,000 replies interrupted since: say where
            proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack on stderr
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"the chat hung after Ctrl-C; the server had {len(fake.servicer.requests)} requests; "
                        f"stdout {out!r}; stderr:\n{err}")
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "reply interrupted" in err
        # The interrupted turn is dropped: the second request carries only the second message.
        second = fake.servicer.requests[1].prompt.messages.messages
        assert [(m.role, m.content) for m in second] == [("user", "second")]
