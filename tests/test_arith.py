import pytest

from opd_harness.registry import TASKS
from opd_harness.tasks.synthetic.arith import ArithOptions, solve_steps

ArithTask = TASKS.get("arith")  # the class as the registry names it (a task's name is its entry point's)


def test_solve_steps_respects_precedence():
    lines, value = solve_steps([3, 4, 5], ["+", "*"])
    assert (lines, value) == (["4*5=20", "3+20=23"], 23)
    lines, value = solve_steps([7, 2, 3, 4], ["-", "*", "+"])
    assert value == 7 - 2 * 3 + 4 and lines[0] == "2*3=6"


def test_splits_are_deterministic_disjoint_and_correct():
    task = ArithTask(ArithOptions(n_train=500, n_test=50, seed=3))
    test, train = task.load("test"), task.load("train")
    assert [p.question for p in test] == [p.question for p in ArithTask(ArithOptions(n_train=500, n_test=50, seed=3)).load("test")]
    assert len(test) == 50 and len(train) == 500
    assert not {p.question for p in test} & {p.question for p in train}
    assert test[0].id == "test-0" and train[7].id == "train-7"
    for p in test:
        expression = p.question.removeprefix("Compute ").removesuffix(".\n")
        assert eval(expression) == int(p.answer)  # noqa: S307 (our own generated integers)
        assert p.solution.endswith(f"\\boxed{{{p.answer}}}")


def test_unknown_split_and_impossible_sizes():
    with pytest.raises(ValueError, match="splits"):
        ArithTask().load("validation")
    with pytest.raises(ValueError, match="cannot draw"):
        ArithTask(ArithOptions(num_ops=1, max_operand=2, max_mul_operand=2, n_test=100)).load("test")


def test_grading_is_tristate_and_uses_math_verify():
    task = ArithTask(ArithOptions(n_test=3))
    problems = task.load("test")
    completions = [problems[0].solution, "no answer here", "\\boxed{" + str(int(problems[2].answer) + 1) + "}"]
    scores = task.grade_many(problems, completions)
    assert [s.status for s in scores] == ["pass", "fail", "fail"]
    assert scores[0].extracted == problems[0].answer
    assert task.grader[0] == "math-verify"
