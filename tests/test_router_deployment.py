"""A loopback deployment, every part a real process: one Redis, two nodes (each its own store, prefill
and decode), and routers in front of both decode replicas. Every answer equals Hugging Face's; with
--policy prefix a chat's second turn lands where its first was; with round robin it lands on the other
node and still finds the first turn's blocks through Redis; a decode replica killed mid-run costs at
most the requests it had in flight. Routing is what is tested, not security: every part serves
plaintext (`--insecure`); tests/test_auth.py puts a router in front of a secure replica."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from client import Client
from client.client import KVServeError, Result
from client.metrics import parse_metrics
from kvserve.bench.target import free_port
from kvserve.stack.stack import Service, Stack, StackConfig, start_service, stop_service
from tests.polling import wait_until
from tests.redis_fixtures import RedisServer
from tests.stack_fixtures import BLOCK_SIZE, assert_greedy_matches, greedy, model_dir, oracle, tokens

pytestmark = pytest.mark.slow

ARCH = "llama"


@dataclass
class Deployment:
    redis: RedisServer
    nodes: list[Stack]
    routers: dict[str, tuple[Service, int]]  # policy -> (router, metrics port)

    def decode_addrs(self) -> list[str]:
        return [n.addr for n in self.nodes]

    def routed(self, policy: str) -> dict[str, float]:
        """Requests each replica got from the router of `policy`."""
        port = self.routers[policy][1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            samples = parse_metrics(resp.read().decode())
        return {addr: samples.get(f'kvserve_router_requests_total{{policy="{policy}",replica="{addr}"}}', 0.0)
                for addr in self.decode_addrs()}

    def healthy(self, policy: str) -> float:
        port = self.routers[policy][1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode()).get("kvserve_router_healthy_replicas", 0.0)


def start_router(decode: list[str], policy: str) -> tuple[Service, int]:
    port = free_port()
    service = start_service(f"router-{policy}", "kvserve.router", [
        "--listen", "127.0.0.1:0", "--decode", ",".join(decode), "--policy", policy, "--metrics-port", str(port),
        "--insecure"])
    return service, port


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("deployment")
    redis = RedisServer.start(tmp / "redis")
    nodes: list[Stack] = []
    routers: dict[str, tuple[Service, int]] = {}
    try:
        for name in ("a", "b"):
            config = StackConfig(model_dir=model_dir(ARCH), data_dir=tmp / name, decode_port=0, prefill_port=0,
                                 store_port=0, host_capacity="256MiB", disk_capacity="0",
                                 extra_store_args=["--remote-url", redis.url], insecure=True)
            nodes.append(Stack(config, log_dir=tmp / name / "logs").start())
        addrs = [n.addr for n in nodes]
        for policy in ("prefix", "round-robin"):
            routers[policy] = start_router(addrs, policy)
        d = Deployment(redis, nodes, routers)
        for policy in routers:
            wait_until(lambda policy=policy: d.healthy(policy) == 2, timeout_s=30, interval_s=0.1,
                       message=f"the {policy} router never saw both replicas healthy")
        yield d
    finally:
        for service, _ in routers.values():
            stop_service(service)
        for node in nodes:
            node.stop()
        redis.stop()


def router_client(d: Deployment, policy: str) -> Client:
    return Client(d.routers[policy][0].addr, timeout_s=120)


def chat_turns(client: Client, seed: int, d: Deployment, policy: str) -> list[tuple[str, Result]]:
    """Two turns of one chat, each checked against the oracle: (the replica that served it, its result)."""
    out = []
    history = tokens(8 * BLOCK_SIZE + 5, seed=seed)
    for turn in range(2):
        before = d.routed(policy)
        want, logits = oracle(ARCH, history, 6)
        result = greedy(client, history, 6)
        assert_greedy_matches(list(result.token_ids), want, logits)
        after = d.routed(policy)
        (served,) = [a for a in after if after[a] > before[a]]
        out.append((served, result))
        history = [*history, *result.token_ids, *tokens(BLOCK_SIZE + 3, seed=seed * 10 + turn)]
    return out


def test_with_prefix_routing_a_second_turn_lands_where_the_first_was(deployment: Deployment) -> None:
    with router_client(deployment, "prefix") as client:
        chats = [chat_turns(client, seed=500 + i, d=deployment, policy="prefix") for i in range(4)]
    for (first, _), (second, result) in chats:
        assert second == first
        assert result.usage.cached_tokens >= 8 * BLOCK_SIZE  # the first turn's prompt, at least
    assert {first for (first, _), _ in chats} == set(deployment.decode_addrs())  # new chats spread


def test_with_round_robin_the_other_node_finds_the_first_turn_through_redis(deployment: Deployment) -> None:
    with router_client(deployment, "round-robin") as client:
        for i in range(3):
            (first, _), (second, result) = chat_turns(client, seed=600 + i, d=deployment, policy="round-robin")
            assert second != first
            # the other node never saw this chat: what it found came from Redis (written behind, so a
            # block may still be on its way; the first turn's first blocks are long there)
            assert result.usage.cached_tokens > 0


def test_the_router_learns_from_a_nodes_events_what_it_computed_without_the_router(
        deployment: Deployment) -> None:
    """A prompt sent straight to node B (not through the router) is stored there; B's store announces
    the blocks, B's decode relays them, and the router sends the next turn to B."""
    node_b = deployment.nodes[1].addr
    for chat in range(2):  # without the events, ties would send one of two new chats to A
        history = tokens(8 * BLOCK_SIZE + 3, seed=650 + chat)
        with Client(node_b, timeout_s=60) as direct:
            answer = greedy(direct, history, 4)
        history = [*history, *answer.token_ids, *tokens(BLOCK_SIZE, seed=660 + chat)]
        time.sleep(1.0)  # the events' way: store -> decode -> router
        before = deployment.routed("prefix")
        with router_client(deployment, "prefix") as client:
            want, logits = oracle(ARCH, history, 4)
            assert_greedy_matches(list(greedy(client, history, 4).token_ids), want, logits)
        after = deployment.routed("prefix")
        assert after[node_b] == before[node_b] + 1


def test_a_killed_decode_replica_costs_at_most_its_requests_in_flight(deployment: Deployment) -> None:
    prompts = [tokens(2 * BLOCK_SIZE + 7, seed=700 + i) for i in range(4)]
    wants = [oracle(ARCH, p, 8) for p in prompts]
    kill_at: list[float] = []
    outcomes: list[tuple[float, float, bool]] = []  # (sent, ended, ok)
    lock = threading.Lock()
    stop = threading.Event()

    def user(i: int, client: Client) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                result = greedy(client, prompts[i], 8)
                assert_greedy_matches(list(result.token_ids), *wants[i])
                ok = True
            except KVServeError:
                ok = False
            with lock:
                outcomes.append((sent, time.monotonic(), ok))

    with router_client(deployment, "prefix") as client:
        threads = [threading.Thread(target=user, args=(i, client)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        wait_until(lambda: len(outcomes) >= 8, timeout_s=120, message="the users got no 8 answers")
        victim = deployment.nodes[0].service("decode")
        kill_at.append(time.monotonic())
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        after = len(outcomes)
        wait_until(lambda: len(outcomes) >= after + 12, timeout_s=120,
                   message="the users got no 12 answers after the kill")
        stop.set()
        for t in threads:
            t.join(60)
    failed = [(sent, ended) for sent, ended, ok in outcomes if not ok]
    assert all(sent < kill_at[0] < ended for sent, ended in failed), failed  # only those in flight at the kill
    assert len(failed) <= len(prompts)
    assert sum(ok for sent, _, ok in outcomes if sent > kill_at[0]) >= 12


def test_the_prefix_router_serves_on_after_a_replica_died(deployment: Deployment) -> None:
    """After the kill above, one replica is left: new chats go there, and answers stay right."""
    wait_until(lambda: deployment.healthy("prefix") == 1, timeout_s=10, interval_s=0.1,
               message="the prefix router did not see one replica left")
    assert deployment.healthy("prefix") == 1
    with router_client(deployment, "prefix") as client:
        ids = tokens(3 * BLOCK_SIZE, seed=800)
        want, logits = oracle(ARCH, ids, 6)
        assert_greedy_matches(list(greedy(client, ids, 6).token_ids), want, logits)



def test_decode_spreads_over_prefill_replicas_and_skips_a_dead_one(tmp_path: Path) -> None:
    """One node with two prefill replicas: decode sends requests to both; with one SIGKILLed, every
    request still gets the oracle's answer from the other."""
    model = str(model_dir(ARCH))
    services: list[Service] = []
    try:
        store = start_service("kvstore", "kvstore", ["--listen", "127.0.0.1:0", "--host-capacity", "256MiB",
                                                     "--insecure"], tmp_path / "kvstore.log")
        services.append(store)
        ports = [free_port(), free_port()]
        prefills = [start_service(f"prefill-{i}", "prefill_service", [
            "--model", model, "--kvstore", store.addr, "--listen", "127.0.0.1:0", "--metrics-port", str(port),
            "--insecure"],
            tmp_path / f"prefill-{i}.log") for i, port in enumerate(ports)]
        services += prefills
        decode = start_service("decode", "decode_service", [
            "--model", model, "--kvstore", store.addr, "--prefill", ",".join(p.addr for p in prefills),
            "--listen", "127.0.0.1:0", "--local-prefill-tokens", "0", "--insecure"],  # every prompt to prefill
            tmp_path / "decode.log")
        services.append(decode)
        prompts = [tokens(2 * BLOCK_SIZE + i, seed=900 + i) for i in range(6)]
        wants = [oracle(ARCH, p, 5) for p in prompts]
        with Client(decode.addr, timeout_s=60) as client:
            for p, (want, logits) in zip(prompts, wants, strict=True):
                assert_greedy_matches(list(greedy(client, p, 5).token_ids), want, logits)
            served = [prefill_requests(port) for port in ports]
            assert all(n >= 1 for n in served), served
            prefills[0].process.send_signal(signal.SIGKILL)
            prefills[0].process.wait(10)
            for p, (want, logits) in zip(prompts, wants, strict=True):
                assert_greedy_matches(list(greedy(client, p, 5).token_ids), want, logits)
        assert prefill_requests(ports[1]) == served[1] + len(prompts)
    finally:
        for service in reversed(services):
            stop_service(service)


def prefill_requests(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        samples = parse_metrics(resp.read().decode())
    return sum(v for k, v in samples.items() if k.startswith("kvserve_prefill_requests_total"))
