"""What the demo app runs, without any Gradio: the visitor's request, the models, the prompt, and the two streamed
generations it compares.

Everything here calls the library: the prompts come from `hf_budgetdraft.demo.tasks`, the generations are plain
`generate()` calls with the public `cache_implementation` / `cache_config` / `assistant_model` / `use_mtp` API, the
numbers from `record_speculation()` and `cache_nbytes`, and the losslessness check from
`hf_budgetdraft.runs.token_diff`. The app adds only input checks, streaming and bookkeeping for display.

- `request`: the page's options and `RunRequest.check` (`DemoInputError` for a bad input);
- `store`: `ModelStore`, each model choice loaded once (local folders checked first);
- `prompts`: `build_prompt`, a built-in task or the visitor's text;
- `streaming`: `stream_generate`, one `generate()` in a worker thread, progress after every chunk;
- `columns`: an output column's token texts and origins (accepted draft token or the target's own);
- `methods`: a request's `generate()` arguments;
- `summary`: `summarize`, the numbers of a finished comparison;
- `compare`: `compare`, AR then the speculative method, as a stream of `Snapshot`s.
"""

from .columns import IncrementalDecoder, SideView, chunk_origins, token_origins
from .compare import Snapshot, compare
from .comparison_numbers import full_kv_bytes, summarize
from .methods import decoding_kwargs, draft_spec, method_title, require_method, speculative_call
from .prompts import Prompt, build_prompt, read_upload
from .request import (
    DEFAULT_MODEL,
    DEFAULT_SPEC,
    DRAFTER_METHODS,
    METHOD_LABELS,
    MODEL_DEMO,
    MODEL_DEMO_BASE,
    MODEL_LABELS,
    MODEL_LOCAL,
    MODEL_SMOKE,
    MODEL_SMOKE_MTP,
    MTP_METHODS,
    POLICY_NAMES,
    SOURCE_LABELS,
    UPLOAD_SUFFIXES,
    DemoInputError,
    RunRequest,
    devices,
    model_choices,
)
from .store import TOKENIZER_DIR, ModelPair, ModelStore, check_compatible, check_model_folder
from .streaming import RunProgress, stream_generate

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_SPEC",
    "DRAFTER_METHODS",
    "METHOD_LABELS",
    "MODEL_DEMO",
    "MODEL_DEMO_BASE",
    "MODEL_LABELS",
    "MODEL_LOCAL",
    "MODEL_SMOKE",
    "MODEL_SMOKE_MTP",
    "MTP_METHODS",
    "POLICY_NAMES",
    "SOURCE_LABELS",
    "TOKENIZER_DIR",
    "UPLOAD_SUFFIXES",
    "DemoInputError",
    "IncrementalDecoder",
    "ModelPair",
    "ModelStore",
    "Prompt",
    "RunProgress",
    "RunRequest",
    "SideView",
    "Snapshot",
    "build_prompt",
    "check_compatible",
    "check_model_folder",
    "chunk_origins",
    "compare",
    "decoding_kwargs",
    "draft_spec",
    "full_kv_bytes",
    "method_title",
    "devices",
    "model_choices",
    "read_upload",
    "require_method",
    "speculative_call",
    "stream_generate",
    "summarize",
    "token_origins",
]
