"""The rule scorers against tables, and verl's choice of scorer by data_source."""

import pytest

from rlmesh.reward import gsm8k, math_dapo, math_reward
from rlmesh.reward.arithmetic import compute_score as arithmetic_score
from rlmesh.reward.builtin import builtin_for, default_compute_score

LONG = "Let me think about this. " * 20  # 500 characters of reasoning

GSM8K_TABLE = [
    # (response, ground truth, score, what it shows)
    ("So she has 72 apples.\n#### 72", "72", 1.0, "correct"),
    ("So she has 71 apples.\n#### 71", "72", 0.0, "wrong"),
    ("So she has 72 apples.", "72", 0.0, "missing ####"),
    ("####72", "72", 0.0, "no space after ####"),
    ("#### 5 first, then I fixed it: #### 72", "72", 1.0, "several ####: the last wins"),
    ("#### 72 first, then I changed my mind: #### 5", "72", 0.0, "several ####: the last wins (wrong)"),
    ("#### 1,234", "1234", 1.0, "commas stripped"),
    ("#### 1,234,567", "1234567", 1.0, "several commas"),
    ("#### -5", "-5", 1.0, "negative"),
    ("#### -5", "5", 0.0, "sign matters"),
    ("#### 3.5", "3.5", 1.0, "decimal"),
    ("#### 3.50", "3.5", 0.0, "exact string match, not numeric"),
    ("#### $72", "72", 0.0, "a $ before the number is not an answer"),
    (LONG + "#### 72", "72", 1.0, "long text, answer in the last 300 characters"),
    ("#### 72\n" + LONG, "72", 0.0, "answer before the last 300 characters is not seen"),
    ("#### 123" + "y" * 294, "123", 0.0, "the 300-character cut falls inside '####'"),
    ("#### 123" + "y" * 292, "123", 1.0, "exactly 300 characters: all seen"),
    ("", "72", 0.0, "empty response"),
]


@pytest.mark.parametrize(
    ("response", "truth", "expected", "what"), GSM8K_TABLE, ids=[t[3] for t in GSM8K_TABLE]
)
def test_gsm8k_table(response, truth, expected, what):
    assert gsm8k.compute_score(response, truth) == expected, what
    assert default_compute_score("openai/gsm8k", response, truth) == expected


def test_gsm8k_format_score_is_for_a_wrong_answer_only():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0


def test_gsm8k_extraction_methods():
    assert gsm8k.extract_solution("a #### 1,5 b") == "15"
    assert gsm8k.extract_solution("nothing here") is None
    assert gsm8k.extract_solution("first 12, then 72") is None
    assert gsm8k.extract_solution("first 12, then 72", method="flexible") == "72"
    assert gsm8k.compute_score("first 12, then 72", "72", method="flexible") == 1.0
    assert gsm8k.extract_solution("the end 72.", method="flexible") == "72."  # verl keeps the dot
    assert gsm8k.extract_solution("only . here", method="flexible") == "."  # verl's loop quirk
    assert gsm8k.extract_solution("no digits", method="flexible") is None
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("x", method="fuzzy")


MATH_TABLE = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0, "shorthand frac"),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, "0.5 is a half"),
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0, "leading dot"),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0, "a/b"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0, "dfrac"),
    ("\\boxed{x = 5}", "5", 1.0, "short lhs dropped"),
    ("\\boxed{10\\%}", "10", 1.0, "percent"),
    ("\\boxed{90^\\circ}", "90", 1.0, "degrees"),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0, "sqrt shorthand"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0, "left/right and spaces"),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0, "units"),
    ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}", 1.0, "nested braces"),
    ("\\boxed{1} no wait \\boxed{2}", "2", 1.0, "last box wins"),
    ("the answer is \\boxed 5", "5", 1.0, "boxed with a space"),
    ("\\boxed{3}", "4", 0.0, "wrong"),
    ("the answer is 4", "4", 0.0, "no box"),
    ("\\boxed{4", "4", 0.0, "unclosed box"),
]


@pytest.mark.parametrize(
    ("response", "truth", "expected", "what"), MATH_TABLE, ids=[t[3] for t in MATH_TABLE]
)
def test_math_table(response, truth, expected, what):
    assert math_reward.compute_score(response, truth) == expected, what
    assert default_compute_score("lighteval/MATH", response, truth) == expected


def test_math_normalisation_pieces():
    assert math_reward.strip_string("\\tfrac{1}{2}") == "\\frac{1}{2}"
    assert math_reward.strip_string(" 3 / 4 ") == "\\frac{3}{4}"  # spaces go first
    assert math_reward.strip_string("3/4.0") == "3/4.0"  # not integer/integer: left alone
    assert math_reward.last_boxed_only_string("a \\fbox{7} b") == "\\fbox{7}"
    assert math_reward.is_equiv(None, None) and not math_reward.is_equiv("1", None)


def test_math_dapo_answer_lines():
    assert math_dapo.compute_score("work...\nAnswer: 5", "5") == {"score": 1.0, "acc": True, "pred": "5"}
    wrong = math_dapo.compute_score("Answer: 6", "5")
    assert wrong["score"] == -1.0 and wrong["acc"] is False
    assert math_dapo.compute_score("Answer: 1,000 dollars", "1000")["acc"]
    assert math_dapo.compute_score("no answer line", "5")["pred"] == "[INVALID]"
    assert math_dapo.compute_score("x \\boxed{5}", "5", strict_box_verify=True)["acc"]


def test_math_reads_every_box_form_and_dapo_only_braces_as_in_verl():
    # verl's math_reward.py (Hendrycks MATH) finds `\boxed x` and `\fbox{x}` too; math_dapo.py only `\boxed{x}`.
    assert math_reward.last_boxed_only_string("so \\fbox{5}") == "\\fbox{5}"
    assert math_reward.last_boxed_only_string("so \\fbox{5}", braced_only=True) is None
    assert math_reward.compute_score("so \\boxed 5$", "5") == 1.0
    assert math_dapo.compute_score("so \\fbox{5}", "5", strict_box_verify=True)["pred"] is None
    assert math_dapo.compute_score("so \\boxed 5", "5", strict_box_verify=True)["pred"] is None
    text = "\\boxed{4} then \\boxed 5$"
    assert math_reward.last_boxed_only_string(text) == "\\boxed 5"
    assert math_reward.last_boxed_only_string(text, braced_only=True) == "\\boxed{4}"
    assert math_reward.remove_boxed("\\boxed 5") == "5"
    with pytest.raises(ValueError, match="not a boxed answer"):
        math_reward.remove_boxed("\\boxed 5", braced_only=True)
    assert math_dapo.is_correct_minerva("Answer: 7", "so \\boxed{7}", gt_need_extract=True) == (True, "7")


ARITHMETIC_TABLE = [
    ("#### 33", "33", 1.0, True),
    ("#### 033", "33", 1.0, True),
    ("#### -12", "-12", 1.0, True),
    ("#### 32", "33", 0.0, True),
    ("33", "33", 0.0, False),
    ("#### 33.0", "33", 0.0, True),
    ("#### 1 then #### 33", "33", 1.0, True),
]


@pytest.mark.parametrize(("response", "truth", "score", "formatted"), ARITHMETIC_TABLE)
def test_arithmetic_table(response, truth, score, formatted):
    result = arithmetic_score(response, truth)
    assert result["score"] == score and result["acc"] == (score == 1.0) and result["format"] == formatted
    assert default_compute_score("arithmetic", response, truth) == result


def test_arithmetic_scores_the_data_module_targets():
    from rlmesh.data.arithmetic import arithmetic_row, format_arithmetic_solution

    row = arithmetic_row("12+7*3", "train", 0)
    truth = row["reward_model"]["ground_truth"]
    assert arithmetic_score(format_arithmetic_solution(truth) + "<|endoftext|>", truth)["score"] == 1.0


def test_data_sources_map_as_in_verl():
    assert builtin_for("openai/gsm8k") == "gsm8k"
    assert builtin_for("DigitalLearningGmbH/MATH-lighteval") == "math"
    assert builtin_for("math") == "math_dapo"
    assert builtin_for("aime2024") == "math_dapo"
    assert builtin_for("arithmetic") == "arithmetic"
    assert builtin_for("unknown/source") is None
    with pytest.raises(NotImplementedError, match=r"unknown/source.*, aime\*$"):
        default_compute_score("unknown/source", "#### 1", "1")
