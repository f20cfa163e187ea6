"""What a difference in each fingerprint component means: the reason codes a refused restore is reported
with (`REASON_PRIORITY`, most specific first; `REASONS` for the fixed components; `SETTING_CLASSES` for
llama-server options), `reason_for` a component, and `HARMLESS`, the settings left out of the fingerprint
because they cannot change the KV a prompt produces. The codes are part of the API (`x-kv-reason`)."""

from __future__ import annotations

# Reason codes, most specific first: when several components differ, the first code in this order wins.
REASON_PRIORITY: tuple[str, ...] = (
    "FINGERPRINT_FORMAT_CHANGED",
    "RUNTIME_KEY_CHANGED",
    "BACKEND_CHANGED",
    "MODEL_FINGERPRINT_CHANGED",
    "BUILD_CHANGED",
    "PROCESS_VISIBILITY_CHANGED",
    "MODEL_OVERRIDE_CHANGED",
    "KV_LAYOUT_CHANGED",
    "ROPE_CHANGED",
    "LORA_CHANGED",
    "CONTROL_VECTOR_CHANGED",
    "DEVICE_PLACEMENT_CHANGED",
    "LLAMA_CONFIG_CHANGED",
    "ENVIRONMENT_CHANGED",
    "RUNTIME_SETTINGS_CHANGED",
    "KV_CANARY_CHANGED",
)

# fixed component -> reason code given when a snapshot's fingerprint differs in it
REASONS: dict[str, str] = {
    "format": "FINGERPRINT_FORMAT_CHANGED",
    "runtime_key": "RUNTIME_KEY_CHANGED",
    "backend": "BACKEND_CHANGED",
    "model_path": "MODEL_FINGERPRINT_CHANGED",
    "model_file": "MODEL_FINGERPRINT_CHANGED",
    "build_info": "BUILD_CHANGED",
    "server_binary": "BUILD_CHANGED",
    "server_libs": "BUILD_CHANGED",
    "process": "PROCESS_VISIBILITY_CHANGED",
    "config_files": "LLAMA_CONFIG_CHANGED",
    "environ": "ENVIRONMENT_CHANGED",
    "canary_kv": "KV_CANARY_CHANGED",
}


def _words(*groups: str) -> list[str]:
    return " ".join(groups).split()


def _classes(code: str, names: str) -> dict[str, str]:
    return dict.fromkeys(_words(names), code)


# canonical llama-server option -> reason code (a fingerprinted option not listed: RUNTIME_SETTINGS_CHANGED)
SETTING_CLASSES: dict[str, str] = {
    **_classes(
        "MODEL_FINGERPRINT_CHANGED",
        "model model-url docker-repo hf-repo hf-file mmproj mmproj-url mmproj-auto embd-gemma-default "
        "fim-qwen-1.5b-default fim-qwen-3b-default fim-qwen-7b-default fim-qwen-7b-spec fim-qwen-14b-spec "
        "fim-qwen-30b-default gpt-oss-20b-default gpt-oss-120b-default vision-gemma-4b-default "
        "vision-gemma-12b-default",
    ),
    **_classes("MODEL_OVERRIDE_CHANGED", "override-kv"),
    **_classes(
        "KV_LAYOUT_CHANGED",
        "cache-type-k cache-type-v flash-attn swa-full kv-unified kv-unified-per-slot kv-offload",
    ),
    **_classes(
        "ROPE_CHANGED",
        "rope-scaling rope-scale rope-freq-base rope-freq-scale yarn-orig-ctx yarn-ext-factor "
        "yarn-attn-factor yarn-beta-slow yarn-beta-fast",
    ),
    **_classes("LORA_CHANGED", "lora lora-scaled lora-init-without-apply"),
    **_classes("CONTROL_VECTOR_CHANGED", "control-vector control-vector-scaled control-vector-layer-range"),
    **_classes(
        "DEVICE_PLACEMENT_CHANGED",
        "device gpu-layers split-mode tensor-split main-gpu override-tensor cpu-moe n-cpu-moe n-cpu-ffn "
        "fit fit-target fit-ctx rpc repack no-host op-offload mmproj-offload mmproj-device",
    ),
}

# Settings that cannot change the KV a given token sequence produces, nor its layout in a state file.
HARMLESS: frozenset[str] = frozenset(
    _words(
        # informational commands (a server started with them does not serve)
        "help version cache-list completion-bash list-devices",
        # CPU scheduling, loading, batching: how fast, not what
        "threads threads-batch cpu-mask cpu-range cpu-strict prio poll cpu-mask-batch cpu-range-batch "
        "cpu-strict-batch prio-batch poll-batch numa load-mode lazy-mode mmap mlock direct-io check-tensors "
        "warmup cont-batching batch-size ubatch-size spec-draft-threads spec-draft-threads-batch "
        "spec-draft-cpu-mask spec-draft-cpu-range spec-draft-cpu-strict spec-draft-prio spec-draft-poll "
        "spec-draft-cpu-mask-batch spec-draft-cpu-strict-batch spec-draft-prio-batch spec-draft-poll-batch",
        # slots and prompt caches (ctx-size and parallel are recorded and checked against each snapshot)
        "ctx-size parallel cache-ram cache-idle-slots ctx-checkpoints checkpoint-min-step context-shift "
        "keep cache-prompt cache-reuse slot-prompt-similarity slot-save-path sleep-idle-seconds "
        "defrag-thold predict",
        # HTTP, API, web UI, credentials
        "host port reuse-port path api-prefix cors-origins cors-methods cors-headers cors-credentials "
        "timeout sse-ping-interval threads-http api-key api-key-file ssl-key-file ssl-cert-file metrics "
        "props slots media-path ui ui-config ui-config-file ui-mcp-proxy tools tools-runtime "
        "mcp-servers-config mcp-servers-json agent alias tags offline hf-token",
        # logging
        "log-disable log-file log-jsonl log-prompts-dir log-colors verbose verbosity log-prefix "
        "log-timestamps perf",
        # sampling defaults (which token is picked, not the KV of the tokens)
        "samplers seed sampler-seq ignore-eos temp top-k top-p min-p top-nsigma xtc-probability "
        "xtc-threshold typical repeat-last-n repeat-penalty presence-penalty frequency-penalty "
        "dry-multiplier dry-base dry-allowed-length dry-penalty-last-n dry-sequence-breaker "
        "adaptive-target adaptive-decay dynatemp-range dynatemp-exp mirostat mirostat-lr mirostat-ent "
        "logit-bias grammar grammar-file json-schema json-schema-file backend-sampling reverse-prompt "
        "special escape",
        # prompt construction: another template makes other tokens, and only a matching prefix is reused
        "chat-template chat-template-file chat-template-kwargs jinja reasoning-format reasoning "
        "reasoning-effort reasoning-budget reasoning-budget-message reasoning-preserve skip-chat-parsing "
        "prefill-assistant spm-infill embd-normalize",
    )
)


def reason_for(component: str) -> str:
    """The reason code a difference in `component` is reported as."""
    if component in REASONS:
        return REASONS[component]
    kind, _, name = component.partition(":")
    if kind in ("arg", "file"):
        return SETTING_CLASSES.get(name, "RUNTIME_SETTINGS_CHANGED")
    if kind == "env":
        return "ENVIRONMENT_CHANGED"
    return "FINGERPRINT_CHANGED"
