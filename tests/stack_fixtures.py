"""Helpers for the prefill, decode and end-to-end tests: tiny models, the HF oracle, an in-memory
store with fault injection, the two services in process, and the three as real processes, each as a
module-scoped fixture (`stack_fixture`)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from client import Client
from client.client import Result
from kvserve.engine.engine import Engine
from kvserve.engine.model import Model, load_model
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.tiny import init_tiny_model
from kvserve.handoff.transfer import EncodedBlock, encoded_bytes
from kvstore import KVStoreClient, Part, PutResult
from kvstore.client import scatter
from kvstore.device_tier import as_uint8
from tests.engine_fixtures import assert_greedy_matches

ARCHS = ("llama", "qwen2", "gpt2")
BLOCK_SIZE = 16
# Small but not trivial: several layers, grouped-query attention on llama/qwen2, fast on 2 cores.
LAYERS, HIDDEN = 3, 128

__all__ = ["ARCHS", "BLOCK_SIZE", "assert_greedy_matches"]


@cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="kvserve-stack-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def workdir() -> Path:
    return _workdir()


@cache
def model_dir(arch: str) -> Path:
    """A tiny seeded model of `arch`, written once per test process."""
    return init_tiny_model(_workdir() / f"model-{arch}", arch, seed=0, layers=LAYERS, hidden=HIDDEN)


@cache
def _hf_model(arch: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir(arch), local_files_only=True).eval()


def oracle(arch: str, token_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Hugging Face `generate`, greedy, EOS ignored: the tokens and the logits [vocab] of each step."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )
    input_ids = torch.tensor([list(token_ids)])
    # An explicit mask: generate would otherwise mask every prompt token equal to pad_token_id. EOS is
    # ignored only when given as a keyword: in the config, None falls back to the model's own.
    with torch.inference_mode():
        out = _hf_model(arch).generate(  # type: ignore[operator]
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, eos_token_id=None
        )
    got = out.sequences[0, len(token_ids):].tolist()
    assert len(got) == max_new_tokens, f"the oracle stopped after {len(got)} of {max_new_tokens} tokens"
    return got, [step[0] for step in out.logits]


def tokens(n: int, seed: int) -> list[int]:
    """n random byte tokens (valid ids for every tiny model)."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(client: Client, ids: Sequence[int], n: int, **kw: Any) -> Result:
    """`n` new tokens of `ids`, greedy, EOS ignored; `kw` go to `Client.generate` as they are."""
    return client.generate(token_ids=ids, max_tokens=n, ignore_eos=True, **kw)


# --- an in-memory KV store with fault injection ------------------------------------------------


class FakeRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"fake store: {self._code.name}"


@dataclass(frozen=True, slots=True)
class FakeLookup:
    num_hits: int
    tiers: list[int]
    lease_id: str


class NoEvents:
    """A store's Events call on which nothing happens until it is cancelled."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[object]:
        self._cancelled.wait()
        yield from ()

    def cancel(self) -> None:
        self._cancelled.set()


@dataclass
class FakeStore:
    """What KVStoreClient offers, in memory. `down` makes every call fail with UNAVAILABLE."""

    blocks: dict[bytes, bytes] = field(default_factory=dict)
    ephemeral: set[bytes] = field(default_factory=set)
    leases: dict[str, list[bytes]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    corrupted: set[bytes] = field(default_factory=set)  # blocks whose bytes fail their checksum
    checksum_failures: int = 0
    down: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _leases_taken: int = 0

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)

    def put(self, blocks: Iterable[tuple[bytes, EncodedBlock]], ephemeral: bool = False) -> int:
        self._call("put")
        new = 0
        with self._lock:
            for key, payload in blocks:
                assert len(key) == 32
                new += key not in self.blocks
                self.blocks[key] = encoded_bytes(payload)
                if ephemeral:
                    self.ephemeral.add(key)
        return new

    def lookup(self, hashes: Sequence[bytes], lease_ttl_s: float | None = None) -> FakeLookup:
        self._call("lookup")
        with self._lock:
            hits = 0
            while hits < len(hashes) and hashes[hits] in self.blocks:
                hits += 1
            lease = self._lease(list(hashes[:hits])) if lease_ttl_s and hits else ""
        return FakeLookup(hits, [2] * hits, lease)

    def _lease(self, keys: list[bytes], lease_id: str | None = None) -> str:
        """A new lease on ``keys``, or ``lease_id``'s extended ("" if it has ended); under the lock."""
        if lease_id:
            if lease_id not in self.leases:
                return ""
            self.leases[lease_id] += keys
            return lease_id
        lease = f"lease-{self._leases_taken}"
        self._leases_taken += 1
        self.leases[lease] = keys
        return lease

    def put_leased(self, blocks: Iterable[tuple[bytes, EncodedBlock]], lease_ttl_s: float | None, *,
                   lease_id: str | None = None, ephemeral: bool = False) -> PutResult:
        items = list(blocks)
        new = self.put(items, ephemeral)
        if not lease_ttl_s:
            return PutResult(new)
        with self._lock:
            lease = self._lease([key for key, _ in items], lease_id)
        return PutResult(new, lease or None, lease_ttl_s if lease else None)

    def put_tensors_leased(self, blocks: Iterable[tuple[bytes, Sequence[torch.Tensor | bytes]]],
                           lease_ttl_s: float | None, *, lease_id: str | None = None, ephemeral: bool = False
                           ) -> PutResult:
        return self.put_leased([(key, b"".join(as_uint8(p).cpu().numpy().tobytes() for p in parts))
                                for key, parts in blocks], lease_ttl_s, lease_id=lease_id, ephemeral=ephemeral)

    def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        # As the real client: a block whose bytes no longer match what was put is a miss.
        self._call("get")
        with self._lock:
            self.checksum_failures += sum(h in self.corrupted for h in hashes)
            return [None if h in self.corrupted else self.blocks.get(h) for h in hashes]

    def get_into(self, hashes: Sequence[bytes], buffers: Sequence[Sequence[Part]]) -> list[int | None]:
        return [len(p) if p is not None and scatter(p, parts) else None
                for p, parts in zip(self.get(hashes), buffers, strict=True)]

    def tensor_device(self) -> None:
        return None  # no device arena: a pool on a GPU moves its blocks as host bytes

    def get_tensors(self, hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        return [None if p is None else torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in self.get(hashes)]

    def put_tensors(self, blocks: Iterable[tuple[bytes, Sequence[torch.Tensor | bytes]]], ephemeral: bool = False) -> int:
        return self.put([(key, b"".join(as_uint8(p).cpu().numpy().tobytes() for p in parts)) for key, parts in blocks],
                        ephemeral)

    def release(self, lease_id: str) -> None:
        self._call("release")
        with self._lock:
            self.leases.pop(lease_id, None)

    def remove(self, hashes: Sequence[bytes]) -> int:
        self._call("remove")
        with self._lock:
            self.ephemeral.difference_update(hashes)
            self.corrupted.difference_update(hashes)
            return sum(self.blocks.pop(h, None) is not None for h in hashes)

    def close(self) -> None:
        pass

    def watch_events(self) -> NoEvents:
        return NoEvents()

    def corrupt(self, key: bytes) -> None:
        self.corrupted.add(key)

    def persistent_keys(self) -> set[bytes]:
        return set(self.blocks) - self.ephemeral


@cache
def _model(arch: str, role: str) -> Model:
    return load_model(model_dir(arch))


TEST_KV_CACHE_BYTES = 64 << 20


def engine(arch: str, role: str = "prefill", block_size: int = BLOCK_SIZE, config: SchedulerConfig | None = None
           ) -> Engine:
    """An Engine over a model loaded once per (arch, role): prefill and decode never share one."""
    return Engine(_model(arch, role), block_size=block_size, config=config, kv_cache_memory=TEST_KV_CACHE_BYTES)


# --- prefill and decode in this process, over a FakeStore --------------------------------------


class LocalStack:
    """The prefill and decode gRPC servers in this process (port 0), sharing one FakeStore (or the
    KVStoreClient given). Decode runs `arch` with `block_size` unless told otherwise, to test
    misconfigured deployments. A test's fakes go in at public seams: `wrap_decode_model` and
    `wrap_prefill_model` map the Model each engine runs, `wrap_prefill_client` the PrefillClient decode
    reaches prefill with."""

    def __init__(
        self, arch: str, store: FakeStore | KVStoreClient | None = None, config: SchedulerConfig | None = None,
        block_size: int = BLOCK_SIZE, decode_arch: str | None = None, decode_block_size: int | None = None,
        *, decode_kv_cache_memory: int = TEST_KV_CACHE_BYTES, wrap_decode_model: Callable[[Model], Model] | None = None,
        wrap_prefill_model: Callable[[Model], Model] | None = None,
        wrap_prefill_client: Callable[[Any], Any] | None = None, local_prefill_tokens: int = 0,
    ) -> None:
        from decode_service.metrics import DecodeMetrics
        from decode_service.replica import SERVICE_NAME as REPLICA
        from decode_service.replica import DecodeReplicaServicer, PoolEvents
        from decode_service.server import DecodeServicer
        from decode_service.server import add_to_server as add_decode
        from decode_service.service import DecodeService
        from kvserve.rpc.server import Server
        from prefill_service.client import PrefillClient, PrefillReplicas
        from prefill_service.metrics import PrefillMetrics
        from prefill_service.server import add_to_server as add_prefill
        from prefill_service.service import PrefillService
        from protos.kvserve.v1 import decode_pb2_grpc

        self.arch = arch
        self.block_size = block_size
        self.store = store if store is not None else FakeStore()
        self.prefill_server = Server("127.0.0.1:0", metrics_port=0)
        prefill_metrics = PrefillMetrics(self.prefill_server.registry)
        prefill_model = _model(arch, "prefill")
        if wrap_prefill_model is not None:
            prefill_model = wrap_prefill_model(prefill_model)
        prefill_engine = Engine(prefill_model, block_size=block_size, config=config,
                                kv_cache_memory=TEST_KV_CACHE_BYTES)
        self.prefill = PrefillService(prefill_engine, self.store, prefill_metrics)  # type: ignore[arg-type]
        self.prefill.start()
        add_prefill(self.prefill_server, self.prefill)
        self.prefill_addr = f"127.0.0.1:{self.prefill_server.start()}"
        self.decode_server = Server("127.0.0.1:0", metrics_port=0)
        decode_model = _model(decode_arch or arch, "decode")
        if wrap_decode_model is not None:
            decode_model = wrap_decode_model(decode_model)
        self.decode_metrics = DecodeMetrics(self.decode_server.registry)
        pool_events = PoolEvents()
        decode_engine = Engine(decode_model, block_size=decode_block_size or block_size, config=config,
                               kv_cache_memory=decode_kv_cache_memory, on_pool_change=pool_events.changed)
        prefill_client = PrefillClient(self.prefill_addr, timeout_s=30.0)
        if wrap_prefill_client is not None:
            prefill_client = wrap_prefill_client(prefill_client)
        self.decode = DecodeService(
            decode_engine, self.store, PrefillReplicas([prefill_client]), self.decode_metrics,  # type: ignore[arg-type]
            local_prefill_tokens,
        )
        front = DecodeServicer(self.decode)
        add_decode(self.decode_server, front)
        self.decode_server.add(decode_pb2_grpc.add_DecodeReplicaServicer_to_server,
                               DecodeReplicaServicer(front, decode_engine, self.store, self.decode_metrics,  # type: ignore[arg-type]
                                                     pool_events),
                               REPLICA)
        self.decode.start()
        self.addr = f"127.0.0.1:{self.decode_server.start()}"

    def prefill_metric(self, name: str, **labels: str) -> float:
        return self.prefill_server.registry.get_sample_value(name, labels) or 0.0

    def decode_metric(self, name: str, **labels: str) -> float:
        return self.decode_server.registry.get_sample_value(name, labels) or 0.0

    def close(self) -> None:
        self.decode_server.stop(0)
        self.decode.stop()
        self.prefill_server.stop(0)
        self.prefill.stop()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the three services as real processes on loopback ------------------------------------------


class ProcessStack:
    """A KV store process, and a prefill + decode process per arch, all on port 0 over loopback.

    Started with `python -m <package>`; ports come from their `LISTENING <port>` lines. Logs go to
    files under the test workdir (named in failures). `decode_args` go to each decode. The tests that use
    it are about caching, generation and failures, not security: every service serves plaintext
    (`--insecure`), and says so; tests/test_tls.py and tests/test_auth.py start secure ones.
    """

    def __init__(self, name: str, archs: Sequence[str], store_args: Sequence[str] = (),
                 decode_args: Sequence[str] = ()) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from kvserve.stack.stack import Service, start_service

        for arch in archs:  # build here, once: the start-up threads below must not race to write them
            model_dir(arch)
        self.dir = workdir() / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_args = ["--disk-capacity", "256MiB", "--disk-path", str(self.dir / "lmdb"), "--insecure",
                           *store_args]
        self.decode_args = list(decode_args)
        self.store: Service = start_service(
            "kvstore", "kvstore", ["--listen", "127.0.0.1:0", *self.store_args], self.dir / "kvstore.log"
        )
        self.prefill: dict[str, Service] = {}
        self.decode: dict[str, Service] = {}
        try:
            with ThreadPoolExecutor(len(archs)) as pool:
                for arch, svc in zip(archs, pool.map(self._start_prefill, archs), strict=True):
                    self.prefill[arch] = svc
                for arch, svc in zip(archs, pool.map(self._start_decode, archs), strict=True):
                    self.decode[arch] = svc
        except BaseException:
            self.stop()
            raise

    def _common(self, arch: str) -> list[str]:
        return ["--model", str(model_dir(arch)), "--kvstore", self.store.addr, "--block-size", str(BLOCK_SIZE),
                "--listen", "127.0.0.1:0", "--log-level", "WARNING", "--insecure"]

    def _start_prefill(self, arch: str):  # type: ignore[no-untyped-def]
        from kvserve.stack.stack import start_service

        return start_service(f"prefill-{arch}", "prefill_service", self._common(arch),
                             self.dir / f"prefill-{arch}.log")

    def _start_decode(self, arch: str):  # type: ignore[no-untyped-def]
        from kvserve.stack.stack import start_service

        return start_service(f"decode-{arch}", "decode_service",
                             [*self._common(arch), "--prefill", self.prefill[arch].addr, *self.decode_args],
                             self.dir / f"decode-{arch}.log")

    def kill_store(self) -> None:
        """SIGKILL: no flush, no goodbye."""
        self.store.process.kill()
        self.store.process.wait()

    def restart_store(self) -> None:
        """A new store process on the same port (same disk path)."""
        from kvserve.stack.stack import start_service

        self.store = start_service("kvstore", "kvstore", ["--listen", f"127.0.0.1:{self.store.port}",
                                                          *self.store_args], self.dir / "kvstore.log")

    def stop(self) -> None:
        """SIGTERM to every process at once, then wait (SIGKILL after 10 s)."""
        import signal
        import subprocess

        procs = [svc.process for svc in [*self.decode.values(), *self.prefill.values(), self.store]]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> ProcessStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- either stack as a module-scoped fixture -----------------------------------------------------

S = TypeVar("S", LocalStack, ProcessStack)


def stack_fixture(kind: Callable[..., S], *args: Any, params: Sequence[dict[str, Any]] | None = None,
                  ids: Sequence[str] | Callable[[Any], str] | None = None,
                  start_in: Callable[[], AbstractContextManager[object]] = nullcontext, **options: Any) -> Any:
    """A module-scoped fixture of `kind(*args, **options)` (LocalStack or ProcessStack), started inside
    `start_in()` and stopped after the module's last test; named as the module attribute it is assigned to:
    `stack = stack_fixture(LocalStack, "llama")`. With `params`, a stack per dict of further options, each
    test run on each, named by `ids`."""

    @pytest.fixture(scope="module", params=params, ids=ids)
    def fixture(request: pytest.FixtureRequest) -> Iterator[S]:
        with start_in():
            stack = kind(*args, **options, **(request.param if params is not None else {}))
        with stack:
            yield stack

    return fixture
