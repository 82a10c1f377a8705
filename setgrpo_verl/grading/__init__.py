"""Rubric grading for SetGRPO: data model, rule checks, judges, graders, the dual scorer and data converters.

Typical use (the command line's judge probe, or any script)::

    from setgrpo_verl.grading import DualScorer, load_ifbench_rubrics
    scorer = DualScorer({"type": "local_hf", "temperature": 1.0, "seed": 0})
    scores = scorer.score(prompts, responses, rubrics)   # scores.point, scores.reference: float64 [N]
    scorer.identity                                      # {name, model, temperature, template_hash}

verl: the reward manager ``setgrpo_dual`` (:mod:`setgrpo_verl.integration.reward_manager`) wraps the same scorer.
Heavy dependencies (transformers, openai, if-verifiable) are imported lazily.
"""

from .convert import (
    IFBENCH_QUALITY_CRITERIA,
    convert_rubric_file,
    drop_duplicate_rows,
    ifbench_to_verl,
    load_ifbench_rubrics,
    load_validation_rubrics,
    read_rubric_rows,
    rubrics_to_verl_rows,
    validate_verl_rows,
    write_verl_parquet,
)
from .dual import DualScorer, DualScores
from .graders import (
    FunctionGrader,
    RubricGrader,
    as_rubric,
    build_grader,
    check_stochastic_grader,
    check_stochastic_judge,
    check_unparsed,
    grader_identity,
    verdict_seed,
)
from .http_judge import JudgeContextError, OpenAIJudge
from .local_judge import LocalHFJudge
from .protocol import (
    JUDGE_TEMPLATE_VERSION,
    VERDICT_WORDS,
    VERDICT_WORDS_BY_LANGUAGE,
    JudgeReply,
    JudgeRequest,
    parse_verdict,
    read_reply,
    strip_reasoning,
    template_hash,
)
from .noisy import NoisyGrader
from .rubric import (
    Criterion,
    GradeResult,
    GradingError,
    GradingItem,
    Rubric,
    RubricRowError,
    Rule,
    Verdict,
    rubric_score,
)
from .rules import NLTK_DATA_RULES, UnknownRuleError, check_rule

__all__ = [
    "Criterion",
    "DualScorer",
    "DualScores",
    "FunctionGrader",
    "GradeResult",
    "GradingError",
    "GradingItem",
    "grader_identity",
    "IFBENCH_QUALITY_CRITERIA",
    "JUDGE_TEMPLATE_VERSION",
    "JudgeReply",
    "JudgeRequest",
    "LocalHFJudge",
    "NoisyGrader",
    "NLTK_DATA_RULES",
    "JudgeContextError",
    "OpenAIJudge",
    "Rubric",
    "RubricGrader",
    "RubricRowError",
    "Rule",
    "UnknownRuleError",
    "VERDICT_WORDS",
    "VERDICT_WORDS_BY_LANGUAGE",
    "Verdict",
    "as_rubric",
    "build_grader",
    "check_stochastic_grader",
    "check_stochastic_judge",
    "check_rule",
    "check_unparsed",
    "convert_rubric_file",
    "drop_duplicate_rows",
    "ifbench_to_verl",
    "load_ifbench_rubrics",
    "load_validation_rubrics",
    "parse_verdict",
    "read_reply",
    "read_rubric_rows",
    "rubric_score",
    "rubrics_to_verl_rows",
    "strip_reasoning",
    "template_hash",
    "validate_verl_rows",
    "verdict_seed",
    "write_verl_parquet",
]
