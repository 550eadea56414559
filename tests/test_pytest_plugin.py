"""The pytest plugin kvserve installs (kvserve/pytest_plugin.py), run as its users run it: in a pytest
of their own (pytester, in a subprocess) that asks for its fixtures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kvserve.pytest_plugin import MODEL_ENV, SERVICES
from tests.processes import alive

pytest_plugins = ["pytester"]

USAGE = Path(__file__).resolve().parents[1] / "docs" / "USAGE.md"

# Run after USAGE.md's example, in one session with it. The last test fails on purpose, after
# stopping the prefill service, so that its report shows what prefill logged during the test.
STACK_TESTS = '''
import json
import os
import signal
import time
from pathlib import Path


def test_the_store_keeps_blocks_in_shared_memory(kvserve_stack, kvserve_store):
    assert kvserve_stack.shm_dir is not None and (kvserve_stack.shm_dir / "arena.sock").exists()
    assert kvserve_store.info().arena_socket == str(kvserve_stack.shm_dir / "arena.sock")
    assert kvserve_store.shm_dir() == kvserve_stack.shm_dir
    Path("stack.json").write_text(json.dumps({"pids": kvserve_stack.pids, "shm_dir": str(kvserve_stack.shm_dir)}))


def test_an_openai_client_of_the_http_url(kvserve_stack, kvserve_http_url):
    import ssl

    import openai

    kw = kvserve_stack.openai_kwargs
    client = openai.OpenAI(base_url=kvserve_http_url, api_key=kw["api_key"], max_retries=0,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=kw["ca"])))
    [model] = client.models.list()
    reply = client.completions.create(model=model.id, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4


def test_fails_after_prefill_stopped(kvserve_stack):
    os.kill(kvserve_stack.pids["prefill"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "stopping" not in kvserve_stack.log("prefill") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert False, "fails on purpose"
'''


def readme_example() -> str:
    """The python block of docs/USAGE.md's section on testing against kvserve."""
    section = USAGE.read_text().split("## Testing your service against kvserve", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "USAGE.md's testing section has no python example"
    return match.group(1)


def test_the_plugin_is_registered_with_pytest() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert plugins.get("kvserve") == "kvserve.pytest_plugin"


def test_loading_the_plugin_imports_no_grpc_and_no_torch() -> None:
    """Every pytest run of a project with kvserve installed loads the plugin: it must cost nothing."""
    probe = ("import sys, pytest; before = set(sys.modules); import kvserve.pytest_plugin; "
             "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(done.stdout.split())
    assert "kvserve" in loaded
    assert loaded.isdisjoint({"grpc", "google", "protos", "kvstore", "client", "torch", "transformers"}), loaded


@pytest.mark.slow
@pytest.mark.parametrize("given", ["option", "env", "ini"])
def test_the_model_folder_comes_from_the_option_then_env_then_ini(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Each source names a missing folder, so the stack refuses to start before anything runs, and
    says which folder it was given."""
    pytester.makeini("[pytest]\nkvserve_model = models/from-ini\n")
    pytester.makepyfile("def test_uses_the_stack(kvserve_stack):\n    pass\n")
    args = ["-p", "no:cacheprovider"]
    if given == "option":
        args += ["--kvserve-model", "from-option"]
    if given in ("option", "env"):
        monkeypatch.setenv(MODEL_ENV, str(pytester.path / "from-env"))
    else:
        monkeypatch.delenv(MODEL_ENV, raising=False)
    result = pytester.runpytest_subprocess(*args, timeout=120)
    result.assert_outcomes(errors=1)
    expected = {"option": "from-option", "env": "from-env", "ini": "models/from-ini"}[given]
    result.stdout.fnmatch_lines([f"*model folder {pytester.path / expected} does not exist*"])
    assert "kvserve decode log" not in result.stdout.str()  # nothing started, no log to show


@pytest.mark.slow
def test_a_session_gets_a_real_stack_and_leaves_nothing_behind(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MODEL_ENV, raising=False)  # the tiny model, built for the session
    pytester.makepyfile(test_readme=readme_example(), test_stack=STACK_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=400)
    result.assert_outcomes(passed=3, failed=1)

    out = result.stdout.str()
    # Under -q too, what it builds and starts, once, each on a line of its own.
    started = [line for line in result.stdout.lines if line.startswith("kvserve: ")
               and not line.startswith(("kvserve: prefill: ", "kvserve: decode: "))]  # progress while starting
    assert started[0].startswith("kvserve: building a tiny model for this session in ") and len(started) == 10
    assert [line.split(" on ")[0] for line in started[1:9]] == [
        f"kvserve: {what}" for name in SERVICES for what in (f"starting {name} ...", f"{name} ready")]
    assert started[9].startswith("kvserve: stack ready in ")
    failure = out.split("test_fails_after_prefill_stopped", 1)[1]
    assert "AssertionError: fails on purpose" in failure  # not on the way there
    for name in ("kvstore", "prefill", "decode", "http"):
        assert out.count(f" kvserve {name} log ") == 1, name  # in the failed test's report only
    prefill = failure.split(" kvserve prefill log ", 1)[1].split(" kvserve decode log ", 1)[0]
    assert "(what it logged during this test)" in prefill and "signal 15: stopping" in prefill
    assert "(nothing logged during this test; its end)" in failure.split(" kvserve decode log ", 1)[1]

    started = json.loads((pytester.path / "stack.json").read_text())
    assert sorted(started["pids"]) == ["decode", "http", "kvstore", "prefill"]
    assert [name for name, pid in started["pids"].items() if alive(pid)] == []
    assert not os.path.exists(started["shm_dir"])
    assert not list(Path(started["shm_dir"]).parent.glob(f"kvserve-{started['pids']['kvstore']}-*"))


SHADOWED_TESTS = '''
import client
import engine
import router


def test_the_fixtures_serve_beside_modules_named_as_kvserves(kvserve_stack, kvserve_client):
    assert (client.NAME, engine.NAME, router.NAME) == ("theirs", "theirs", "theirs")
    assert len(kvserve_client.generate(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    import client as again

    assert again.NAME == "theirs"
'''


@pytest.mark.slow
def test_a_project_with_its_own_client_engine_and_router_modules_runs_the_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:  # pytester: its folder, its files
    """`python -m pytest` puts the project's folder first on the path: its client.py shadows kvserve's client
    package there (and, before the services ran with -P, in every service the stack started)."""
    monkeypatch.delenv(MODEL_ENV, raising=False)
    pytester.makepyfile(client="NAME = 'theirs'\n", engine="NAME = 'theirs'\n", router="NAME = 'theirs'\n",
                        test_project=SHADOWED_TESTS)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # as the project's own run
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=pytester.path,
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]
    shadows = [line for line in done.stdout.splitlines() if "shadows kvserve's client package" in line]
    assert shadows == [f"kvserve: {pytester.path / 'client.py'} shadows kvserve's client package; "
                       "the kvserve fixtures load kvserve's own"]
