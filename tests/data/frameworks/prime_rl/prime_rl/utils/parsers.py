import re

# (regex, parser_name) — first match wins.
TOOL_CALL_PARSER_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Trinity-Large-Thinking uses the Qwen3-Coder tool format; the rest of the family is Hermes.
    (re.compile(r"^arcee-ai/Trinity-Large-Thinking"), "qwen3_coder"),
    (re.compile(r"^arcee-ai/Trinity-"), "hermes"),
    (re.compile(r"^deepseek-ai/DeepSeek-V3\.2"), "deepseek_v32"),
    (re.compile(r"^deepseek-ai/DeepSeek-V3\.1"), "deepseek_v31"),
    (re.compile(r"^zai-org/GLM-4\.5"), "glm45"),
    (re.compile(r"^zai-org/GLM-4\.7"), "glm47"),
    (re.compile(r"^zai-org/GLM-5"), "glm47"),
    (re.compile(r"^MiniMaxAI/MiniMax-M2"), "minimax_m2"),
    (re.compile(r"^openai/gpt-oss"), "openai"),
    (re.compile(r"^poolside/Laguna"), "poolside_v1"),
    (re.compile(r"^PrimeIntellect/INTELLECT-3"), "qwen3_coder"),
    (re.compile(r"^nvidia/NVIDIA-Nemotron-3"), "qwen3_coder"),
    (re.compile(r"^stepfun-ai/Step-3\.5"), "step3p5"),
    # Qwen3.5/3.6/3.8 and Qwen3-Coder use qwen3_coder — must be before the Qwen3 catch-all.
    (re.compile(r"^Qwen/Qwen3\.(5|6|8)-"), "qwen3_coder"),
    (re.compile(r"^Qwen/Qwen3-Coder"), "qwen3_coder"),
    (re.compile(r"^Qwen/Qwen3-"), "hermes"),
]

REASONING_PARSER_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Trinity-Large-Preview doesn't reason; the Thinking/Mini/Nano variants do.
    (re.compile(r"^arcee-ai/Trinity-(Large-Thinking|Mini|Nano)"), "deepseek_r1"),
    (re.compile(r"^deepseek-ai/DeepSeek-V3\.[12]"), "deepseek_r1"),
    (re.compile(r"^zai-org/GLM-"), "glm45"),
    (re.compile(r"^MiniMaxAI/MiniMax-M2"), "minimax_m2_append_think"),
    # openai/gpt-oss has no entry here — vLLM's harmony serving path splits reasoning natively.
    (re.compile(r"^poolside/Laguna"), "poolside_v1"),
    (re.compile(r"^PrimeIntellect/INTELLECT-3"), "deepseek_r1"),
    (re.compile(r"^nvidia/NVIDIA-Nemotron-3-Super"), "nemotron_v3"),
    (re.compile(r"^nvidia/NVIDIA-Nemotron-3-Nano"), "nano_v3"),
    (re.compile(r"^nvidia/NVIDIA-Nemotron-3\.5"), "nano_v3"),
    (re.compile(r"^stepfun-ai/Step-3\.5"), "step3p5"),
    # Only Qwen3 Thinking models reason — Instruct/base models do not.
    (re.compile(r"^Qwen/Qwen3-.*Thinking"), "deepseek_r1"),
    (re.compile(r"^Qwen/Qwen3\.(5|6|8)-"), "qwen3"),
]


def _resolve(model_name: str, patterns: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, parser_name in patterns:
        if pattern.search(model_name):
            return parser_name
    return None


def resolve_tool_call_parser(model_name: str) -> str | None:
    return _resolve(model_name, TOOL_CALL_PARSER_PATTERNS)


def resolve_reasoning_parser(model_name: str) -> str | None:
    return _resolve(model_name, REASONING_PARSER_PATTERNS)
