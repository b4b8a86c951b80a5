"""The http engine: against a real `vllm serve` (same numbers as the offline vllm engine), and
against tiny loopback servers for the SGLang dialect, retries and every failure message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_port

from mismatch.engines import ReplayRequest, engine_kinds, load_engine, parse_spec
from mismatch.engines.http import HTTPOptions
from mismatch.engines.spec import options_from
from mismatch.errors import MismatchError, SpecError
from mismatch.replay import plan_replay
from mismatch.rollouts import load_rollouts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "engines"
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
for _key, _value in VLLM_ENV.items():  # the offline engine below runs in this process
    os.environ.setdefault(_key, _value)
Route = Callable[[dict[str, Any] | None], tuple[int, Any]]


@contextmanager
def _server(routes: dict[str, Route]) -> Iterator[str]:
    """A loopback JSON server: routes map "METHOD /path" to body -> (status, payload)."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            route = routes.get(f"{method} {self.path}", lambda _: (404, {"error": {"message": "no route"}}))
            status, payload = route(body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _toml(tmp_path: Path, **options: Any) -> str:
    path = tmp_path / "engine.toml"
    lines = ['engine = "http"'] + [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _models(owned_by: str) -> Route:
    return lambda _: (200, {"object": "list", "data": [{"id": "tiny", "owned_by": owned_by}]})


REQUEST = ReplayRequest(tokens=np.array([1, 7, 9, 4]), generated=np.array([0, 0, 1, 1], bool),
                        score_from=2)


def test_http_is_registered_and_a_url_spec_is_an_http_engine() -> None:
    assert "http" in engine_kinds()
    assert parse_spec("http://127.0.0.1:8000/v1").options == {"url": "http://127.0.0.1:8000/v1"}


def test_example_http_tomls_have_valid_options() -> None:
    paths = sorted(EXAMPLES.glob("http-*.toml"))
    assert [p.name for p in paths] == ["http-sglang.toml", "http-vllm.toml"]
    for path in paths:
        options = options_from(HTTPOptions, parse_spec(str(path)))
        assert options.url.startswith("http://") and options.api in ("openai", "sglang")


def test_a_server_without_prompt_logprobs_is_one_clear_error(tiny_checkpoint, tmp_path) -> None:
    completion = {"choices": [{"index": 0, "text": "x", "logprobs": None}]}  # a plain OpenAI answer
    with _server({"GET /v1/models": _models("openai"),
                  "POST /v1/completions": lambda _: (200, completion)}) as url:
        engine = load_engine(f"{url}/v1", str(tiny_checkpoint))
        assert (engine.describe()["api"], engine.describe()["model"]) == ("openai", "tiny")
        with pytest.raises(MismatchError) as err:
            engine.replay([REQUEST])
    assert str(err.value) == (
        f"server at {url} returned no prompt_logprobs; is it vLLM >= 0.5.5, or did a proxy drop "
        "the extra field? (for SGLang set api = \"sglang\")")


def test_an_unreachable_server_fails_after_the_retries(tiny_checkpoint, tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there any more
    spec = _toml(tmp_path, url=f"{url}/v1", api="openai", model="tiny", retries=2, backoff=0.01)
    engine = load_engine(spec, str(tiny_checkpoint))
    started = time.perf_counter()
    with pytest.raises(MismatchError, match=rf"^server at {url}/v1/completions unreachable after "
                                            r"3 attempts: .*refused"):
        engine.replay([REQUEST])
    assert engine.describe()["num_retries"] == 2
    assert time.perf_counter() - started < 5
    with pytest.raises(MismatchError,
                       match=rf"^server at {url}/v1/models unreachable after 1 attempt: "):
        load_engine(_toml(tmp_path, url=url, retries=0), str(tiny_checkpoint))  # api auto asks


def test_5xx_is_retried_and_4xx_is_reported_with_the_servers_reason(tiny_checkpoint,
                                                                     tmp_path) -> None:
    answers = iter([(503, {"error": {"message": "busy"}}),
                    (200, {"choices": [{"prompt_logprobs": [
                        None, {"7": {"logprob": -1.5}}, {"9": {"logprob": -0.25}},
                        {"4": {"logprob": -9999.0}}], "prompt_token_ids": [1, 7, 9, 4]}]}),
                    (400, {"error": {"message": "This model's maximum context length is 3"}})])
    with _server({"GET /v1/models": _models("vllm"),
                  "POST /v1/completions": lambda _: next(answers)}) as url:
        engine = load_engine(_toml(tmp_path, url=url, backoff=0.01), str(tiny_checkpoint))
        logp = engine.replay([REQUEST])[0]
        # vLLM's server writes -inf as -9999.0 (JSON has no infinity): read it back as -inf.
        np.testing.assert_array_equal(logp, [-0.25, -np.inf])
        assert engine.describe()["num_retries"] == 1
        with pytest.raises(MismatchError) as err:
            engine.replay([REQUEST])
    assert str(err.value) == (f"server at {url}/v1/completions answered HTTP 400: "
                              "This model's maximum context length is 3")


def test_sglang_generate_is_detected_and_read(tiny_checkpoint, tmp_path) -> None:
    seen: list[dict[str, Any]] = []

    def generate(body: dict[str, Any] | None) -> tuple[int, Any]:
        assert body is not None
        seen.append(body)
        ids = body["input_ids"]
        triples = [[None, ids[0], None]] + [[-0.5 * i, t, None] for i, t in enumerate(ids[1:], 1)]
        return 200, {"text": "x", "meta_info": {"input_token_logprobs": triples,
                                                "output_token_logprobs": [[-1.0, 3, None]]}}

    with _server({"GET /v1/models": _models("sglang"), "POST /generate": generate}) as url:
        engine = load_engine(url, str(tiny_checkpoint))
        calls: list[int] = []
        logp = engine.replay([REQUEST, REQUEST], progress=calls.append)
    assert engine.describe()["api"] == "sglang" and engine.describe()["logprob_semantics"] == "raw"
    for got in logp:
        np.testing.assert_array_equal(got, [-1.0, -1.5])
    assert calls == [2, 2]
    assert seen[0] == {"input_ids": [1, 7, 9, 4], "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0}}


def test_bad_http_options_are_spec_errors(tiny_checkpoint, tmp_path) -> None:
    with pytest.raises(SpecError, match=r"^engine 'http': unknown option 'concurency' \(valid: "
                                        r"api, backoff, checkpoint, concurrency, model, retries, "
                                        r"timeout, url\)$"):
        load_engine(_toml(tmp_path, url="http://x", concurency=2), str(tiny_checkpoint))
    with pytest.raises(SpecError, match=r"^engine 'http': option api='tgi' is not one of: auto, "
                                        r"openai, sglang$"):
        load_engine(_toml(tmp_path, url="http://x", api="tgi"), str(tiny_checkpoint))


# A real vLLM server (vllm-cpu here: conftest's vllm_server, the session's) and the offline engine
# with the same config (it shares conftest's vllm_fp32 engine's LLM).

def test_a_vllm_server_gives_the_offline_engines_numbers_bitwise(
        vllm_server, vllm_fp32, tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    """Same kernels, same fp32 values: JSON carries each float exactly (shortest repr round-trips),
    and on this CPU the server's batch composition (3 requests in flight) does not change them."""
    requests = plan_replay(load_rollouts(sampled_rollouts)).requests
    spec = _toml(tmp_path, url=f"{vllm_server}/v1", concurrency=3)
    engine = load_engine(spec, str(tiny_checkpoint))
    calls: list[int] = []
    logp_http = np.concatenate(engine.replay(requests, progress=calls.append))
    facts = engine.describe()
    assert (facts["api"], facts["server"]["owned_by"]) == ("openai", "vllm")
    assert sum(calls) == len(logp_http) and facts["tokens_per_s"] > 0
    top_http = engine.top_rows(requests, 20)  # --distribution 20 over HTTP: prompt_logprobs=20
    offline = load_engine("vllm:dtype=float32,enforce_eager=true,seed=0", str(tiny_checkpoint))
    try:
        logp_offline = np.concatenate(offline.replay(requests))
        top_offline = offline.top_rows(requests, 20)
    finally:
        offline.close()
    print(f"http vs offline vllm: max |dlogp| = {np.nanmax(np.abs(logp_http - logp_offline))!r}")
    assert np.array_equal(logp_http, logp_offline, equal_nan=True)
    # The same top-20 sets, log-probs, prompt-token log-probs and ranks, bit for bit (as sets: the
    # server's JSON and the offline dict list the prompt token in other slots).
    for http_rows, offline_rows in zip(top_http, top_offline, strict=True):
        for row in range(len(http_rows.ids_CK)):
            assert (dict(zip(http_rows.ids_CK[row].tolist(), http_rows.logp_CK[row].tolist()))
                    == dict(zip(offline_rows.ids_CK[row].tolist(), offline_rows.logp_CK[row].tolist())))
        assert np.array_equal(http_rows.sampled_logp_C, offline_rows.sampled_logp_C)
        assert np.array_equal(http_rows.sampled_rank_C, offline_rows.sampled_rank_C)


def test_a_vllm_server_at_k20_against_hf_and_k21_refused(vllm_server, tiny_checkpoint, sampled_rollouts, tmp_path,
                                                         capsys) -> None:
    """--distribution 20 against the real server (its default --max-logprobs is 20): hf fp32 whole
    against the server's top-20, bounded and said so; K = 21 is one line before any replay."""
    from mismatch.cli import main

    spec = _toml(tmp_path, url=f"{vllm_server}/v1", concurrency=3)
    args = ["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--train", "hf", "--infer", spec]
    assert main([*args, "--distribution", "21", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mismatch: error: --distribution 21: the server at {vllm_server} cannot give its top-21 "
                          "log-probs per prompt position (") and "max allowed: 20" in err and "\n" not in err
    assert not (tmp_path / "refused").exists() and not (tmp_path / ".refused.work").exists()
    assert main([*args, "--distribution", "20", "--out", str(tmp_path / "o")]) == 0
    found = json.loads((tmp_path / "o" / "summary.json").read_text())["distribution"]["train/infer"]
    assert found["views"] == {"train": "full", "infer": "top_k"} and found["k"] == 20
    assert not found["exact"] and "lower bounds" in found["bounded"] and found["n_rank_unknown"] == 0
    # The server is vLLM fp32, hf fp32 to rounding: the same top-20 sets, argmax and ranks nearly always.
    assert found["topk_overlap_mean"] > 0.95 and found["argmax_agree_frac"] > 0.95 and found["rank_differs_frac"] < 0.05
    assert 0 <= found["kl"] < 1e-6 and found["tv_mean"] <= found["tv_hi_mean"]
    print(f"hf fp32 vs vllm serve fp32 at K=20: {json.dumps({k: found[k] for k in ('kl', 'tv_mean', 'tv_hi_mean', 'topk_overlap_mean', 'argmax_agree_frac', 'rank_differs_frac', 'tail_b_mean')})}")


def _sglang_answer(fault: Callable[[int, int], tuple[float, int]]) -> Route:
    """/generate answering each input position with fault(position, token) = (logprob, token id)."""
    def answer(body: dict[str, Any] | None) -> tuple[int, Any]:
        ids = (body or {})["input_ids"]
        triples = [None] + [[*fault(i, token), None] for i, token in enumerate(ids) if i > 0]
        return 200, {"text": "", "meta_info": {"input_token_logprobs": triples}}
    return answer


def _openai_answer(value: Callable[[int], float]) -> Route:
    def answer(body: dict[str, Any] | None) -> tuple[int, Any]:
        ids = (body or {})["prompt"]
        rows = [None] + [{str(token): {"logprob": value(i)}} for i, token in enumerate(ids) if i > 0]
        return 200, {"choices": [{"prompt_logprobs": rows, "prompt_token_ids": ids}]}
    return answer


@pytest.mark.parametrize("api, route, needle", [
    ("sglang", _sglang_answer(lambda i, token: (-0.5, token + 1 if i == 5 else token)),
     "answered for token"),
    ("openai", _openai_answer(lambda i: float("nan") if i == 7 else -0.5), "log-prob nan for token"),
    ("openai", _openai_answer(lambda i: float("inf") if i == 7 else -0.5), "log-prob inf for token"),
    ("openai", _openai_answer(lambda i: 0.25 if i == 7 else -0.5), "log-prob 0.25 for token"),
])
def test_a_server_that_answers_wrong_stops_the_audit_with_the_position(tmp_path, capsys, api, route,
                                                                      needle) -> None:
    from test_golden import GOLDEN, stored_checkpoint

    from mismatch.cli import main

    path = "POST /generate" if api == "sglang" else "POST /v1/completions"
    with _server({"GET /v1/models": _models("vllm"), path: route}) as url:
        spec = _toml(tmp_path, url=f"{url}/v1", api=api, model="tiny", retries=0)
        code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts",
                     str(GOLDEN / "rollouts.jsonl"), "--train", "sampler", "--infer", spec,
                     "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    if api == "openai":  # the boundary check names where: rollout, branch, position
        assert "at rollout " in err and " position " in err
    assert not (tmp_path / "o").exists()


def test_a_server_that_drips_its_answer_hits_the_request_deadline(tiny_checkpoint, tmp_path) -> None:
    class Drip(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):  # a byte every 0.1 s: no single read ever times out
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        engine = load_engine(_toml(tmp_path, url=f"{url}/v1", api="openai", model="tiny", timeout=1.0),
                             str(tiny_checkpoint))
        started = time.perf_counter()
        with pytest.raises(MismatchError, match=r"did not answer within timeout = 1 s"):
            engine.replay([REQUEST])
        assert time.perf_counter() - started < 5
    finally:
        server.shutdown()
        server.server_close()


def test_a_resume_against_a_server_that_now_serves_another_model_is_refused(tmp_path, capsys) -> None:
    from test_golden import GOLDEN, stored_checkpoint

    from mismatch.cli import main

    state = {"model": "tiny", "fail": True}
    answer = _openai_answer(lambda i: -0.5)

    def completions(body):
        if state["fail"] and list((tmp_path / ".o.work").glob("infer-*.npy")):
            return 400, {"error": {"message": "gone"}}  # the run dies after its first block
        return answer(body)

    routes = {"GET /v1/models": lambda _: (200, {"data": [{"id": state["model"], "owned_by": "vllm"}]}),
              "POST /v1/completions": completions}
    with _server(routes) as url:
        spec = _toml(tmp_path, url=f"{url}/v1", retries=0, concurrency=1)
        args = ["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(GOLDEN / "rollouts.jsonl"),
                "--train", "stored:trainer", "--infer", spec, "--block-size", "8", "--out", str(tmp_path / "o")]
        assert main(args) == 2
        assert list((tmp_path / ".o.work").glob("infer-*.npy"))
        capsys.readouterr()
        state["model"], state["fail"] = "another", False  # restarted with other weights
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "its infer blocks came from an engine reporting model='tiny'; it now reports model='another'" in err
        state["model"] = "tiny"  # the same server as before: the run resumes
        assert main(args) == 0


@pytest.mark.parametrize("body", [[1, 2], "text", {"choices": "x"}, {"choices": [{"prompt_logprobs": [None, 5, 6, 7]}]},
                                  {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": "x"}}, {}, {}]}]}])
def test_a_body_of_another_shape_is_one_error(tiny_checkpoint, tmp_path, body) -> None:
    with _server({"POST /v1/completions": lambda _: (200, body)}) as url:
        engine = load_engine(_toml(tmp_path, url=f"{url}/v1", api="openai", model="tiny"), str(tiny_checkpoint))
        with pytest.raises(MismatchError, match=rf"^server at {url}"):
            engine.replay([REQUEST])


def test_a_models_listing_of_another_shape_is_one_error(tiny_checkpoint, tmp_path) -> None:
    with _server({"GET /v1/models": lambda _: (200, ["tiny"])}) as url:
        with pytest.raises(MismatchError, match="is not a model list"):
            load_engine(_toml(tmp_path, url=f"{url}/v1"), str(tiny_checkpoint))


# --distribution K over HTTP: each prompt position's top-K (vLLM prompt_logprobs=K, SGLang top_logprobs_num=K).

def _openai_top_answer(k: int, seen: list[dict[str, Any]] | None = None) -> Route:
    """vLLM's completion with prompt_logprobs=k: at each position past 0 the prompt token first,
    then the top-k (token ids 100.. with log-probs log(0.5 / 2^j)), the prompt token at rank 3."""
    def answer(body: dict[str, Any] | None) -> tuple[int, Any]:
        assert body is not None
        if seen is not None:
            seen.append(body)
        ids, asked = body["prompt"], body["prompt_logprobs"]
        if asked > 20:  # vllm/sampling_params.py _validate_logprobs, with the default --max-logprobs
            return 400, {"error": {"message": f"Requested prompt logprobs of {asked}, which is greater than "
                                              "max allowed: 20"}}
        rows: list[Any] = [None]
        for token in ids[1:]:
            top = {str(100 + j): {"logprob": float(np.log(0.5 / 2 ** j)), "rank": j + 1} for j in range(asked)}
            rows.append({str(token): {"logprob": float(np.log(0.125)), "rank": 3}, **top})
        return 200, {"choices": [{"prompt_logprobs": rows, "prompt_token_ids": ids}]}
    return answer


def _sglang_top_answer(seen: list[dict[str, Any]] | None = None) -> Route:
    """SGLang's /generate with top_logprobs_num=k: input_token_logprobs and input_top_logprobs,
    entry 0 None; the prompt token is among the top-k only at even positions."""
    def answer(body: dict[str, Any] | None) -> tuple[int, Any]:
        assert body is not None
        if seen is not None:
            seen.append(body)
        ids, k = body["input_ids"], body.get("top_logprobs_num", 0)  # 0: the sampled-token replay
        own: list[Any] = [[None, ids[0], None]]
        tops: list[Any] = [None]
        for i, token in enumerate(ids[1:], 1):
            top = [[float(np.log(0.5 / 2 ** j)), 100 + j, None] for j in range(k)]
            if i % 2 == 0:
                top[1:2] = [[float(np.log(0.25)), token, None]]
                own.append([float(np.log(0.25)), token, None])
            else:
                own.append([float(np.log(1e-4)), token, None])
            tops.append(top)
        return 200, {"text": "", "meta_info": {"input_token_logprobs": own,
                                               **({"input_top_logprobs": tops} if k else {})}}
    return answer


def test_openai_top_rows_are_read_from_prompt_logprobs(tiny_checkpoint, tmp_path) -> None:
    seen: list[dict[str, Any]] = []
    with _server({"POST /v1/completions": _openai_top_answer(3, seen)}) as url:
        engine = load_engine(_toml(tmp_path, url=f"{url}/v1", api="openai", model="tiny"), str(tiny_checkpoint))
        [rows] = engine.top_rows([REQUEST], 3)
    assert seen[0]["prompt_logprobs"] == 3 and seen[0]["prompt"] == [1, 7, 9, 4]
    # score_from 2: positions 2 and 3; the prompt token kept beside the top-3 (k + 1 slots).
    assert rows.ids_CK.tolist() == [[100, 101, 102, 9], [100, 101, 102, 4]]
    np.testing.assert_array_equal(rows.sampled_logp_C, [np.log(0.125)] * 2)
    np.testing.assert_array_equal(rows.sampled_rank_C, [3, 3])


def test_sglang_top_rows_rank_the_prompt_token_only_inside_the_top_k(tiny_checkpoint, tmp_path) -> None:
    seen: list[dict[str, Any]] = []
    with _server({"GET /v1/models": _models("sglang"), "POST /generate": _sglang_top_answer(seen)}) as url:
        engine = load_engine(url, str(tiny_checkpoint))
        [rows] = engine.top_rows([REQUEST], 3)
    assert seen[0] == {"input_ids": [1, 7, 9, 4], "return_logprob": True, "logprob_start_len": 0,
                       "top_logprobs_num": 3,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0}}
    assert rows.ids_CK.tolist() == [[100, 102, 9, -1], [100, 101, 102, 4]]
    # Position 2: inside the top-3, rank 2 (one above it); position 3: outside, SGLang gives no rank.
    np.testing.assert_array_equal(rows.sampled_rank_C, [2, np.nan])
    np.testing.assert_array_equal(rows.sampled_logp_C, [np.log(0.25), np.log(1e-4)])


def test_an_audit_of_two_servers_compares_their_top_k(tmp_path) -> None:
    """Both sides HTTP (one vLLM-like, one SGLang-like): the whole flow, bounded terms, unknown ranks
    counted apart."""
    from test_golden import GOLDEN, stored_checkpoint

    import mismatch
    from mismatch.results import validate_summary

    with _server({"POST /v1/completions": _openai_top_answer(20)}) as vllm_url, \
            _server({"POST /generate": _sglang_top_answer()}) as sglang_url:
        (tmp_path / "t").mkdir()
        (tmp_path / "i").mkdir()
        train = _toml(tmp_path / "t", url=f"{vllm_url}/v1", api="openai", model="tiny")
        infer = _toml(tmp_path / "i", url=sglang_url, api="sglang")
        result = mismatch.audit(stored_checkpoint(tmp_path / "ckpt"), GOLDEN / "rollouts.jsonl", train=train,
                                infer=infer, distribution=4, out=tmp_path / "o")
    found = result.summary["distribution"]["train/infer"]
    validate_summary(result.summary)
    assert found["views"] == {"train": "top_k", "infer": "top_k"} and not found["exact"]
    # (token 100, the fakes' argmax, is itself sampled at a few positions, where they differ)
    assert found["argmax_agree_frac"] > 0.99 and found["topk_overlap_mean"] < 1
    # Half the positions (odd ones) have the SGLang side's rank unknown; the rest differ (3 vs 2).
    assert 0 < found["n_rank_unknown"] < found["n_positions"] and found["rank_differs_frac"] > 0.99
    import pandas as pd

    table = pd.read_parquet(tmp_path / "o" / "tokens.parquet")
    compared = table[table["trainable"] & table["dist_train_infer_kl_ab"].notna()]
    rank_b = compared["dist_train_infer_rank_b"]
    assert int(rank_b.isna().sum()) == found["n_rank_unknown"]  # NaN in the table, none invented
    assert {row["rank_b"] for row in found["worst"]} - {None} <= set(rank_b.dropna().astype(int))


def test_a_server_that_cannot_give_top_k_is_one_line_before_any_replay(tmp_path, capsys) -> None:
    from test_golden import GOLDEN, stored_checkpoint

    from mismatch.cli import main

    calls: list[dict[str, Any]] = []
    with _server({"POST /v1/completions": _openai_top_answer(21, calls)}) as url:
        spec = _toml(tmp_path, url=f"{url}/v1", api="openai", model="tiny")
        code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(GOLDEN / "rollouts.jsonl"),
                     "--train", spec, "--infer", spec, "--distribution", "21", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"mismatch: error: --distribution 21: the server at {url} cannot give its top-21 log-probs per prompt "
        f"position (server at {url}/v1/completions answered HTTP 400: Requested prompt logprobs of 21, which is "
        "greater than max allowed: 20); start vLLM with --max-logprobs K or more, or pass a smaller K")
    assert [len(call["prompt"]) for call in calls] == [2]  # the probe only: no replay
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.work").exists()
