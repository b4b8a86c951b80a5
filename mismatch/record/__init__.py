"""`mismatch record`: an OpenAI-compatible proxy that records what a vLLM or SGLang server sampled.

Before the flow (ARCHITECTURE.md): harness → proxy → engine, and the proxy writes format v1
rollouts that `mismatch audit` then replays. `exchange` is one sampled completion; `assembly`
groups exchanges into conversations and builds rollout trees (forks, rewritten history as drift);
`dialects` knows what each engine is asked for and how its answers are read and stripped
(`constants`: the bare NaN/Infinity words some servers write, read without re-encoding);
`upstream` checks the engine at start; `writer` appends whole lines; `proxy` is the ASGI app.

Nothing here is imported by `import mismatch`: the proxy's modules load starlette, uvicorn and
httpx (the optional `record` extra) only when `mismatch record` runs.
"""
