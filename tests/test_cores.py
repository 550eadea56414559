"""kvserve.host.cores: compute services of one host lend each other their idle cores, never more than the budgets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.host.cores import TAKE_BACK_WAIT_S, CoreShare, service_share


def share(folder: Path, name: str, threads: int, calls: list[int] | None = None, cores: int = 64,
          take_back_wait_s: float = TAKE_BACK_WAIT_S) -> CoreShare:
    """A service that has started and has nothing to compute yet (it holds its cores until then), on a host of
    `cores` cores."""
    s = CoreShare(folder, name, threads, (calls if calls is not None else []).append, cores,
                  take_back_wait_s=take_back_wait_s)
    s.idle()
    return s


def test_a_service_alone_computes_on_its_budget(tmp_path: Path) -> None:
    calls: list[int] = []
    a = share(tmp_path, "decode-1", 1, calls)
    a.busy()
    assert a.current == 1 and calls == []  # already its budget: torch is not called
    a.idle()


def test_an_idle_peer_lends_its_cores_for_one_step_and_takes_them_back(tmp_path: Path) -> None:
    calls: list[int] = []
    decode = share(tmp_path, "decode-1", 1, calls)
    prefill = share(tmp_path, "prefill-2", 3)
    decode.busy()
    assert decode.current == 4 and calls == [4]
    decode.step_done()
    prefill.busy()  # free again: prefill takes its cores back at once, and lends nothing (decode is busy)
    assert prefill.current == 3
    decode.busy()  # prefill busy: decode on its own budget
    assert decode.current == 1 and calls == [4, 1]
    decode.step_done()
    prefill.idle()
    decode.busy()
    assert decode.current == 4
    decode.idle()


def test_an_owner_waits_for_the_borrowers_step_and_is_not_starved(tmp_path: Path) -> None:
    decode = share(tmp_path, "decode-1", 1)
    prefill = share(tmp_path, "prefill-2", 1)
    decode.busy()
    assert decode.current == 2
    got = threading.Event()

    def take() -> None:
        prefill.busy()
        got.set()

    waiter = threading.Thread(target=take)
    waiter.start()
    time.sleep(0.05)
    assert not got.is_set()  # decode's step still runs on prefill's core
    # decode ends its step and starts the next at once: prefill's file says it waits, so decode lends back
    decode.step_done()
    decode.busy()
    assert decode.current == 1
    waiter.join(2)
    assert got.is_set() and prefill.current == 1
    decode.step_done()
    prefill.idle()


def test_a_killed_peers_files_are_removed_and_a_restarted_one_lends_its_cores_again(tmp_path: Path) -> None:
    code = ("import sys, time; from kvserve.host.cores import CoreShare; "
            f"s = CoreShare({str(tmp_path)!r}, 'prefill-2', 2, lambda n: None); s.busy(); "
            "print('busy', flush=True); time.sleep(60)")
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "busy"
        decode = share(tmp_path, "decode-1", 1)
        decode.busy()
        assert decode.current == 1  # the peer computes
        decode.step_done()
        peer.kill()
        peer.wait()
        decode.busy()  # the kernel dropped the dead peer's locks: its budget is no one's to lend
        assert decode.current == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-1.alive", "decode-1.lock"]
        decode.step_done()
        restarted = share(tmp_path, "prefill-2", 2)
        decode.busy()
        assert decode.current == 3
        decode.step_done()
        restarted.busy()
        decode.busy()
        assert decode.current == 1
    finally:
        peer.kill()


def test_files_without_a_running_service_or_a_budget_are_not_borrowed(tmp_path: Path) -> None:
    (tmp_path / "gone.lock").write_text("4\n")  # no .alive held: removed
    (tmp_path / "gone.alive").write_text("")
    decode = share(tmp_path, "decode-1", 1)
    decode.busy()
    assert decode.current == 1 and not (tmp_path / "gone.lock").exists()
    decode.step_done()
    junk = share(tmp_path, "junk", 1)  # a running, idle service whose file says no number
    (tmp_path / "junk.lock").write_text("many\n")
    decode.busy()
    assert decode.current == 1
    junk.close()


def test_a_service_shares_only_on_a_cpu_and_under_its_host_and_process(tmp_path: Path) -> None:
    assert service_share(None, "decode", 1, "cpu") is None
    assert service_share(str(tmp_path), "decode", 1, "cuda:0") is None  # the GPU computes
    share = service_share(str(tmp_path), "decode", 1, "cpu")
    assert share is not None and share.name == f"decode-{socket.gethostname()}-{os.getpid()}"
    assert (tmp_path / f"{share.name}.lock").read_bytes().split()[0] == b"1"
    share.close()


def test_a_starting_service_holds_its_cores_until_it_is_first_idle(tmp_path: Path) -> None:
    starting = CoreShare(tmp_path, "prefill-2", 1, lambda n: None, 64)  # loading its model, making its pool
    decode = share(tmp_path, "decode-1", 1)
    decode.busy()
    assert decode.current == 1
    decode.step_done()
    starting.idle()
    decode.busy()
    assert decode.current == 2


def test_cores_not_given_back_in_time_stay_wanted_and_are_taken_without_waiting_again(tmp_path: Path) -> None:
    decode = share(tmp_path, "decode-1", 1, take_back_wait_s=0.05)
    prefill = share(tmp_path, "prefill-2", 1)
    prefill.busy()  # a long step on decode's core
    assert prefill.current == 2
    began = time.monotonic()
    decode.busy()  # waits, then computes anyway
    decode.step_done()
    decode.busy()  # the next step does not wait again
    assert time.monotonic() - began < 1.0
    prefill.step_done()
    prefill.busy()  # decode's file says it wants its core: prefill does not take it again
    assert prefill.current == 1
    assert not decode.holding
    decode.busy()
    assert decode.holding
    decode.idle()
    prefill.step_done()
    prefill.busy()
    assert prefill.current == 2


def test_a_peer_made_again_under_its_name_is_not_borrowed_through_the_old_file(tmp_path: Path) -> None:
    """Three services: one dies, another removes its files, it comes back under the same name; the third,
    which had the old file open, must not lend itself the new one's cores while it computes."""
    r = share(tmp_path, "decode-1", 1)
    p = share(tmp_path, "prefill-2", 2)
    r.busy()
    assert r.current == 3  # r has p's file open now
    r.step_done()
    p.close()  # p dies
    q = share(tmp_path, "prefill-3", 1)
    q.busy()  # q finds p gone and removes its files
    q.step_done()
    q.busy()
    p_again = CoreShare(tmp_path, "prefill-2", 2, lambda n: None, 64)
    p_again.busy()
    r.busy()
    assert r.current == 1
    r.step_done()
    p_again.idle()
    q.idle()
    r.busy()
    assert r.current == 4  # the new file, opened afresh


def test_a_file_claiming_more_threads_than_the_cores_lends_no_more_than_the_cores(tmp_path: Path) -> None:
    greedy = share(tmp_path, "prefill-2", 4000)
    decode = share(tmp_path, "decode-1", 1, cores=4)
    decode.busy()
    assert decode.current == 4
    greedy.close()


@pytest.mark.slow
def test_under_up_a_service_computing_alone_computes_on_every_core(tmp_path: Path) -> None:
    """`kvserve up` on the tiny model: a cold prompt is computed by prefill while decode waits, then decode
    streams alone; each computes on the host's every core (its budget and the idle peer's), as its
    `*_engine_steps{threads}` counter shows."""
    import urllib.request

    from client import Client
    from client.metrics import parse_metrics
    from tests.processes import free_ports, running_up

    every = len(os.sched_getaffinity(0))
    if every < 2:
        pytest.skip("one core: nothing to lend")
    decode, prefill, store = free_ports(3)
    base = free_ports(3)[0]
    with running_up(["--data-dir", str(tmp_path / "data"), "--decode-port", str(decode), "--prefill-port",
                     str(prefill), "--store-port", str(store), "--no-http", "--metrics-base-port", str(base),
                     "--insecure"]):  # plaintext metrics pages, read below
        def steps(port: int, service: str) -> dict[str, float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                samples = parse_metrics(resp.read().decode())
            prefix = f"kvserve_{service}_engine_steps_total{{threads=\""
            return {name.removeprefix(prefix).rstrip('"}'): v for name, v in samples.items() if name.startswith(prefix)}

        before = steps(base + 1, "prefill"), steps(base, "decode")
        with Client(f"127.0.0.1:{decode}", timeout_s=300) as client:
            result = client.generate(token_ids=[3 + i % 250 for i in range(1500)], max_tokens=24, ignore_eos=True)
        assert result.usage.cached_tokens == 0 and result.usage.completion_tokens == 24
        after = steps(base + 1, "prefill"), steps(base, "decode")
    for service, old, new in zip(("prefill", "decode"), before, after, strict=True):
        grown = {t: new[t] - old.get(t, 0.0) for t in new if new[t] > old.get(t, 0.0)}
        print(f"\n{service}: this request's forwards by threads {grown}")
        assert grown.get(str(every), 0) > 0, f"{service}'s forwards by threads, this request's: {grown}"
