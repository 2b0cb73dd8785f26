"""Pass@1 evaluation on the paper's benchmarks: loaders, judges, direct/RAG/agentic runs, tables."""

from osvl.eval.benchmarks import (
    FORMATS,
    BenchmarkFormat,
    LoadReport,
    Rejected,
    convert,
    get_format,
    load_benchmark,
)
from osvl.eval.items import EvalItem, read_image_ref, to_prompt
from osvl.eval.judge import (
    AnswerJudge,
    EquivalenceJudge,
    NormalizedMatchJudge,
    load_prompt,
)
from osvl.eval.model_dir import ModelDir, load_model_dir
from osvl.eval.modes import (
    MODES,
    AgenticAnswerer,
    Answerer,
    Attempt,
    DirectAnswerer,
    RagAnswerer,
    extract_answer,
)
from osvl.eval.runner import EvalRunConfig, Evaluator, RunStats, read_records
from osvl.eval.summary import (
    BenchmarkSummary,
    cost_table,
    paper_table,
    pass_table,
    summarize_benchmark,
)
from osvl.eval.tools import (
    EvalToolEnvironment,
    check_offline_paths,
    tool_sections,
)

__all__ = [
    "FORMATS",
    "MODES",
    "AgenticAnswerer",
    "AnswerJudge",
    "Answerer",
    "Attempt",
    "BenchmarkFormat",
    "BenchmarkSummary",
    "DirectAnswerer",
    "EquivalenceJudge",
    "EvalItem",
    "EvalRunConfig",
    "EvalToolEnvironment",
    "Evaluator",
    "LoadReport",
    "ModelDir",
    "NormalizedMatchJudge",
    "RagAnswerer",
    "Rejected",
    "RunStats",
    "check_offline_paths",
    "convert",
    "cost_table",
    "extract_answer",
    "get_format",
    "load_benchmark",
    "load_model_dir",
    "load_prompt",
    "paper_table",
    "pass_table",
    "read_image_ref",
    "read_records",
    "summarize_benchmark",
    "to_prompt",
    "tool_sections",
]
