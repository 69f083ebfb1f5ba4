"""Secrets never reach what ckptctl prints (issue 14, item 6).

A server that echoes request headers in its error got `Authorization: Bearer <key>` printed
inside the `--json` error, and a password in `--endpoint http://user:pass@host` was printed in
log and error lines. One mechanism (`ckptctl.errors.redact`, fed by `register_secret`) is applied
where lines leave: error lines, the JSON document, logs and stage summaries.

The end-to-end cases run the real `update` CLI as one process with the ParameterServer stood in
(tests/support/cpu_ps_rank.py), against a real server that quotes every request header back.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import pytest
from conftest import invoke, run_script
from cpu_jobs import UPDATE_ON_CPU
from fake_server import Behaviour, FakeServer
from locations import TINY

from ckptctl import results
from ckptctl.errors import UsageError, redact, redact_doc, register_secret, register_url_secrets
from ckptctl.inference_server import ServerAddress
from ckptctl.progress import Reporter

KEY = "sk-live-0123456789abcdef"
USER, PASSWORD = "opsuser", "hunter2-pass"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


def _with_password(endpoint: str) -> str:
    return endpoint.replace("http://", f"http://{USER}:{PASSWORD}@")


def _leaks(text: str) -> list[str]:
    return [s for s in (KEY, PASSWORD, BASIC) if s in text]


@pytest.mark.parametrize("password_in_url", [False, True])
def test_an_echoed_api_key_and_url_password_are_never_printed(password_in_url: bool) -> None:
    with FakeServer(Behaviour(mode="echo_headers")) as s:
        endpoint = _with_password(s.endpoint) if password_in_url else s.endpoint
        r = subprocess.run(  # the real update CLI in one process (a job of one needs no torchrun)
            [
                sys.executable, *UPDATE_ON_CPU, "--inference-parallel-size", "1",
                "--endpoint", endpoint, "--json", "--api-key", KEY,
            ],
            capture_output=True, text=True, timeout=60, env={**os.environ, "RANK": "0"},
        )  # fmt: skip
        sent = s.behaviour.requests[-1]["headers"]["Authorization"]
    assert sent == f"Bearer {KEY}"  # the key asked for goes out, even beside a URL password
    assert r.returncode == 1, r.stderr
    assert _leaks(r.stdout + r.stderr) == []
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and "Authorization: Bearer ***" in doc["error"]
    if password_in_url:
        assert f"{USER}:***@" in doc["error"] and f"{USER}:***@" in r.stderr


def test_a_url_password_is_not_in_wait_ready_lines_or_json(server: FakeServer) -> None:
    endpoint = _with_password(server.endpoint)
    ok = invoke("wait-ready", "--endpoint", endpoint, "--timeout", "10", "--json")
    failed = invoke(
        "wait-ready", "--endpoint", endpoint, "--for", "healthy", "--timeout", "0.3", "--json"
    )
    assert ok.exit_code == 0 and failed.exit_code == 4
    for r in (ok, failed):
        assert _leaks(r.stdout + r.stderr) == [], r.stdout + r.stderr
        assert f"{USER}:***@" in r.stderr
    assert f"{USER}:***@" in json.loads(failed.stdout)["error"]


def test_a_malformed_endpoint_with_a_password_is_refused_without_it() -> None:
    r = invoke("wait-ready", "--endpoint", f"ftp://{USER}:{PASSWORD}@host", "--timeout", "1")
    assert r.exit_code == 2
    assert _leaks(r.stdout + r.stderr) == []


# -- the mechanism --------------------------------------------------------------------------


def test_redact_takes_out_registered_secrets_and_recognisable_ones() -> None:
    register_secret("tok-registered-42")
    assert redact("key tok-registered-42 here") == "key *** here"
    assert redact("Authorization: Bearer abcdefgh12345") == "Authorization: Bearer ***"
    assert redact("authorization: basic dXNlcjpwYXNzd29yZA==") == "authorization: basic ***"
    assert redact("at https://me:pw@host:1/x and http://host/") == (
        "at https://me:***@host:1/x and http://host/"
    )
    # Words that merely follow "Bearer" are not secrets; short values are not blanket-replaced.
    assert redact("Invalid Bearer token") == "Invalid Bearer token"
    register_secret("ab")
    assert redact("about a table") == "about a table"


def test_a_url_password_holding_an_at_sign_is_taken_out_whole() -> None:
    """httpx takes `http://user:p@ss@host` (the password `p@ss`, its `@` not encoded), so a
    serve job feeds such a server; a client of the job (`status`, ckptctl.client.status())
    never registered that password, and the pattern alone must take all of it out: it took
    out `p` and printed `ss@host`. A user name that holds an `@` hid the password whole."""
    assert redact("at http://alice:unreg1@pw-tail9@127.0.0.1:1/x?q") == (
        "at http://alice:***@127.0.0.1:1/x?q"
    )
    assert redact("http://al@ice:unreg2pw-tail8@h:1 and http://h:2/p/a@b") == (
        "http://al@ice:***@h:1 and http://h:2/p/a@b"
    )
    assert redact("http://h@x:8000/ y@z") == "http://h@x:8000/ y@z"  # (no password)


def test_a_url_password_is_registered_as_written_decoded_and_as_basic_auth() -> None:
    register_url_secrets("http://u:p%40ss-word@host")
    basic = base64.b64encode(b"u:p@ss-word").decode()
    assert redact(f"p%40ss-word p@ss-word {basic}") == "*** *** ***"


def test_server_address_registers_its_secrets_and_describes_itself_without_them() -> None:
    address = ServerAddress("http://alice:wonderland-7@h:1", api_key="key-for-alice-99")
    assert address.describe() == "http://alice:***@h:1"
    assert redact("echo key-for-alice-99 wonderland-7") == "echo *** ***"


def test_the_json_document_is_redacted_everywhere_in_it() -> None:
    register_secret("json-secret-77")
    stream = io.StringIO()
    results.expect(stream)
    results.write({"error": "x json-secret-77", "ranks": [{"detail": "json-secret-77"}]})
    results.expect(None)
    assert "json-secret-77" not in stream.getvalue()
    assert json.loads(stream.getvalue())["ranks"][0]["detail"] == "***"
    assert redact_doc({"k": ("json-secret-77", 3)}) == {"k": ["***", 3]}


def test_logs_warnings_and_stage_summaries_are_redacted() -> None:
    register_secret("log-secret-55")
    lines: list[str] = []
    reporter = Reporter(lines.append, primary=True)
    reporter.log("log log-secret-55")
    reporter.warn("warn log-secret-55")
    with reporter.stage("verify", "checking") as st:
        st.detail = "detail log-secret-55"
    assert lines and not any("log-secret-55" in line for line in lines), lines


def test_error_lines_are_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    from ckptctl.errors import print_error

    register_secret("err-secret-66")
    print_error("failed with err-secret-66 at http://a:b-pass@h")
    err = capsys.readouterr().err
    assert "err-secret-66" not in err and "b-pass" not in err


# -- a key in the endpoint's query (issue 25, item 5) -------------------------------------------

QUERY_KEY = "s3cret"


def test_a_key_in_the_endpoint_query_is_not_printed(server: FakeServer) -> None:
    endpoint = f"{server.endpoint}/?api_key={QUERY_KEY}&org=acme-research"
    for args in (
        ("wait-ready", "--endpoint", endpoint, "--timeout", "10", "--json"),
        ("wait-ready", "--endpoint", endpoint, "--for", "healthy", "--timeout", "0.3", "--json"),
        ("update", "--dry-run", "--checkpoint-path", str(TINY), "--endpoint", endpoint, "--json"),
    ):
        r = invoke(*args)
        assert r.exit_code in (0, 1, 4), r.stderr  # (the fake server answers 404 to a query)
        printed = r.stdout + r.stderr
        assert QUERY_KEY not in printed and "acme-research" not in printed, printed
        assert "?api_key=***&org=***" in printed


def test_redact_takes_out_query_values_in_urls_only() -> None:
    assert (
        redact("at http://h:1/x?api_key=s3cret&a=1#f (x)")
        == "at http://h:1/x?api_key=***&a=***#f (x)"
    )
    assert redact("'https://h/?token=abc'") == "'https://h/?token=***'"
    assert redact("what? a=b") == "what? a=b"
    # A long query value is taken out also where it shows outside the URL, decoded or not.
    register_url_secrets("http://h/?key=long%2Fsecret-value")
    assert redact("sent long/secret-value and long%2Fsecret-value") == "sent *** and ***"


@pytest.mark.parametrize("path", ["/v1", "/v1/"])
def test_an_openai_base_url_gets_a_hint_to_drop_v1(path: str) -> None:
    r = invoke(
        "update", "--dry-run", "--checkpoint-path", str(TINY), "--json",
        "--endpoint", f"http://127.0.0.1:1{path}?api_key={QUERY_KEY}",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    hint = [line for line in r.stderr.splitlines() if "/v1" in line]
    assert hint == [
        f"warning: --endpoint http://127.0.0.1:1{path}?api_key=*** ends in /v1, the OpenAI "
        "API's base URL; ckptctl calls the server's own routes: drop the /v1 "
        "(http://127.0.0.1:1/?api_key=***)"
    ]
    plain = invoke("update", "--dry-run", "--checkpoint-path", str(TINY), "--endpoint",
                   "http://127.0.0.1:1/v10")  # fmt: skip
    assert "/v1" not in plain.stderr.replace("/v10", "")


def test_status_never_prints_an_endpoint_password() -> None:
    from ckptctl.cli.serve import describe_status

    ServerAddress("http://admin:hunter2pw@127.0.0.1:1")  # what serve registers at start-up
    text = "\n".join(
        describe_status({"targets": ["http://admin:hunter2pw@127.0.0.1:1"]}, "/x.sock")
    )
    assert "hunter2pw" not in text and "127.0.0.1:1" in text


@pytest.mark.parametrize("key", ["ab\ncd", "key with space", "ключ"])
def test_an_api_key_that_cannot_be_a_bearer_token_is_a_usage_error(key: str) -> None:
    with pytest.raises(UsageError, match="printable ASCII"):
        ServerAddress("http://127.0.0.1:1", api_key=key)
    r = run_script("wait-ready", "--timeout", "1", env={"CKPTCTL_API_KEY": key})
    assert r.returncode == 2 and "printable ASCII" in r.stderr
