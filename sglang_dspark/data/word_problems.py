"""Math prompts: generated arithmetic and algebra word problems with worked solutions.

Each template draws its numbers from a seeded RNG, computes the answer exactly with
`Fraction`, and writes a reference solution whose steps are equations
("3 × $2.50 = $7.50") that `check_solution` re-evaluates. The user turn holds the problem and
an instruction to solve it step by step; the reference solution is kept alongside (it is not
used as the response: responses come from the target itself).
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Isla",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
)
ITEMS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("apple", "apples"),
    ("sandwich", "sandwiches"),
    ("ticket", "tickets"),
    ("candle", "candles"),
    ("mug", "mugs"),
    ("plant", "plants"),
    ("book", "books"),
    ("scarf", "scarves"),
)
INSTRUCTIONS = (
    "Solve this step by step.",
    "Show your work and give the final answer.",
    "Explain your reasoning step by step, then state the final answer.",
    "Work through the problem carefully and write the answer on the last line.",
    "Break the problem into steps and solve it.",
)


@dataclass(frozen=True)
class WordProblem:
    template: str
    question: str
    steps: tuple[str, ...]  # equations "lhs = rhs", each checkable
    answer: Fraction
    unit: str = ""  # "$" for money, else appended after the number

    @property
    def answer_text(self) -> str:
        number = fmt(self.answer, money=self.unit == "$")
        if self.unit in ("", "$", "%"):
            return number + ("%" if self.unit == "%" else "")
        return f"{number} {self.unit}"

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\nAnswer: {self.answer_text}"


def fmt(x: Fraction, money: bool = False) -> str:
    """Exact decimal text of x (money: $ and two decimals); fractions as a/b otherwise."""
    sign = "-" if x < 0 else ""
    x = abs(x)
    if money:
        cents = x * 100
        assert cents.denominator == 1, f"{x} is not a whole number of cents"
        return f"{sign}${cents.numerator // 100}.{cents.numerator % 100:02d}"
    if x.denominator == 1:
        return f"{sign}{x.numerator}"
    if 10**4 % x.denominator == 0:  # terminating decimal with at most 4 places
        return sign + f"{float(x):.4f}".rstrip("0").rstrip(".")
    return f"{sign}{x.numerator}/{x.denominator}"


def _m(x: Fraction) -> str:
    return fmt(x, money=True)


# ---------------------------------------------------------------- templates
def shopping(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    (_, a2), (_, b2) = rng.sample(ITEMS, 2)
    na, nb = rng.randint(2, 9), rng.randint(2, 9)
    pa, pb = Fraction(rng.randint(4, 60) * 25, 100), Fraction(rng.randint(4, 60) * 25, 100)
    ta, tb = na * pa, nb * pb
    total = ta + tb
    bill = next(b for b in (10, 20, 50, 100, 200, 300) if b >= total)
    question = (
        f"{name} buys {na} {a2} at {_m(pa)} each and {nb} {b2} at {_m(pb)} each, and "
        f"hands the cashier ${bill}. How much change does {name} get?"
    )
    steps = (
        f"{na} × {_m(pa)} = {_m(ta)}",
        f"{nb} × {_m(pb)} = {_m(tb)}",
        f"{_m(ta)} + {_m(tb)} = {_m(total)}",
        f"{_m(Fraction(bill))} − {_m(total)} = {_m(bill - total)}",
    )
    return WordProblem("shopping", question, steps, bill - total, "$")


def unit_price(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    _, item = rng.choice(ITEMS)
    n, unit = rng.randint(2, 8), Fraction(rng.randint(3, 40) * 25, 100)
    m = rng.choice([k for k in range(3, 15) if k != n])
    question = (
        f"{n} {item} cost {_m(n * unit)} in total. At the same price, how much would "
        f"{name} pay for {m} {item}?"
    )
    steps = (f"{_m(n * unit)} ÷ {n} = {_m(unit)}", f"{m} × {_m(unit)} = {_m(m * unit)}")
    return WordProblem("unit_price", question, steps, m * unit, "$")


def travel_rate(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    speed, t1 = rng.randint(4, 24) * 5, rng.randint(2, 6)
    t2 = rng.choice([k for k in range(2, 10) if k != t1])
    vehicle = rng.choice(("train", "bus", "car", "ferry"))
    question = (
        f"A {vehicle} travels {speed * t1} km in {t1} hours. {name} rides it for {t2} "
        f"hours at the same speed. How many kilometres does {name} travel?"
    )
    steps = (f"{speed * t1} ÷ {t1} = {speed}", f"{speed} × {t2} = {speed * t2}")
    return WordProblem("rates", question, steps, Fraction(speed * t2), "km")


def work_rate(rng: random.Random) -> WordProblem:
    a, b = rng.choice(
        [
            (3, 6),
            (4, 12),
            (6, 12),
            (10, 15),
            (12, 24),
            (20, 30),
            (5, 20),
            (6, 3),
            (12, 4),
            (15, 10),
            (8, 24),
            (9, 18),
        ]
    )
    who = rng.sample(NAMES, 2)
    task = rng.choice(("paint a fence", "weed the garden", "clean the hall", "sort the mail"))
    together = Fraction(1, a) + Fraction(1, b)
    question = (
        f"{who[0]} can {task} alone in {a} hours, and {who[1]} can do it alone in {b} "
        f"hours. How many hours does it take them working together?"
    )
    frac = f"{together.numerator}/{together.denominator}"
    steps = (f"1/{a} + 1/{b} = {frac}", f"1 ÷ ({frac}) = {fmt(1 / together)}")
    return WordProblem("rates", question, steps, 1 / together, "hours")


def ages(rng: random.Random) -> WordProblem:
    young, old = rng.sample(NAMES, 2)
    child, k, n = rng.randint(3, 15), rng.randint(2, 5), rng.randint(2, 10)
    total = (k * child + n) + (child + n)
    question = (
        f"{old} is {k} times as old as {young}. In {n} years, the sum of their ages will "
        f"be {total}. How old is {young} now?"
    )
    steps = (
        f"{total} − 2 × {n} = {total - 2 * n}",
        f"{k} + 1 = {k + 1}",
        f"{total - 2 * n} ÷ {k + 1} = {child}",
    )
    return WordProblem("ages", question, steps, Fraction(child), "years")


def discount_tax(rng: random.Random) -> WordProblem:
    item = rng.choice(("jacket", "bicycle", "lamp", "backpack", "printer", "chair"))
    price = Fraction(rng.randint(2, 30) * 20)
    off, tax = rng.choice((10, 15, 20, 25, 30, 40, 50)), rng.choice((5, 8, 10, 20))
    discount = price * off / 100
    sale = price - discount
    added = sale * tax / 100
    if (added * 100).denominator != 1:  # keep whole cents
        return discount_tax(rng)
    question = (
        f"A {item} costs {_m(price)}. It is on sale for {off}% off, and then a {tax}% "
        f"sales tax is added to the sale price. What is the final price?"
    )
    steps = (
        f"{_m(price)} × {off}/100 = {_m(discount)}",
        f"{_m(price)} − {_m(discount)} = {_m(sale)}",
        f"{_m(sale)} × {tax}/100 = {_m(added)}",
        f"{_m(sale)} + {_m(added)} = {_m(sale + added)}",
    )
    return WordProblem("percentages", question, steps, sale + added, "$")


def percent_change(rng: random.Random) -> WordProblem:
    town = rng.choice(("Riverton", "Oakfield", "Lakeside", "Millbrook"))
    before = rng.randint(4, 40) * 50
    pct = rng.choice((4, 5, 10, 12, 15, 20, 25, 30, 40))
    change = Fraction(before * pct, 100)
    if change.denominator != 1:
        return percent_change(rng)
    after = before + change
    question = (
        f"The population of {town} grew from {before} to {fmt(after)} in one year. By "
        f"what percentage did it grow?"
    )
    steps = (f"{fmt(after)} − {before} = {fmt(change)}", f"{fmt(change)} ÷ {before} × 100 = {pct}")
    return WordProblem("percentages", question, steps, Fraction(pct), "%")


def fractions_left(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    n = a * b * rng.randint(2, 8)
    first = Fraction(n, a)
    rest = n - first
    second = rest / b
    thing = rng.choice(("cookies", "cupcakes", "muffins", "marbles", "stickers"))
    question = (
        f"{name} has {n} {thing}. {name} gives away 1/{a} of them on Monday and 1/{b} "
        f"of the remaining {thing} on Tuesday. How many {thing} are left?"
    )
    steps = (
        f"{n} × 1/{a} = {fmt(first)}",
        f"{n} − {fmt(first)} = {fmt(rest)}",
        f"{fmt(rest)} × 1/{b} = {fmt(second)}",
        f"{fmt(rest)} − {fmt(second)} = {fmt(rest - second)}",
    )
    return WordProblem("fractions", question, steps, rest - second, thing)


def linear_equation(rng: random.Random) -> WordProblem:
    x, a = rng.randint(-12, 20), rng.randint(2, 9)
    b = rng.choice([k for k in range(-30, 31) if k != 0])
    c = a * x + b
    sign = "+" if b > 0 else "−"
    if rng.random() < 0.5:
        question = f"Solve for x: {a}x {sign} {abs(b)} = {c}."
    else:
        question = (
            f"I think of a number, multiply it by {a} and then "
            f"{'add' if b > 0 else 'subtract'} {abs(b)}. The result is {c}. "
            f"What is my number?"
        )
    steps = (f"{c} − {b} = {c - b}" if b > 0 else f"{c} + {-b} = {c - b}", f"{c - b} ÷ {a} = {x}")
    return WordProblem("equations", question, steps, Fraction(x))


def average_needed(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    k = rng.randint(3, 5)
    target = rng.randint(70, 90)
    scores = [rng.randint(60, 100) for _ in range(k)]
    need = target * (k + 1) - sum(scores)
    if not 0 <= need <= 100:
        return average_needed(rng)
    question = (
        f"{name}'s test scores so far are {', '.join(map(str, scores))}. What score "
        f"does {name} need on the next test to have an average of exactly {target}?"
    )
    steps = (
        f"{target} × {k + 1} = {target * (k + 1)}",
        f"{' + '.join(map(str, scores))} = {sum(scores)}",
        f"{target * (k + 1)} − {sum(scores)} = {need}",
    )
    return WordProblem("averages", question, steps, Fraction(need))


TEMPLATES: tuple[Callable[[random.Random], WordProblem], ...] = (
    shopping,
    unit_price,
    travel_rate,
    work_rate,
    ages,
    discount_tax,
    percent_change,
    fractions_left,
    linear_equation,
    average_needed,
)


# ---------------------------------------------------------------- checking
def _evaluate(expr: str) -> Fraction:
    """Exact value of an arithmetic step side ("$3.50 × 2", "1/3 + 1/6")."""
    text = expr.replace("$", "").replace(",", "").replace("×", "*").replace("÷", "/")
    text = text.replace("−", "-").strip()

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left), ev(node.right)
            ops = {
                ast.Add: left.__add__,
                ast.Sub: left.__sub__,
                ast.Mult: left.__mul__,
                ast.Div: left.__truediv__,
            }
            return ops[type(node.op)](right)
        raise ValueError(f"not arithmetic: {expr!r}")

    return ev(ast.parse(text, mode="eval"))


def check_solution(problem: WordProblem) -> None:
    """Raise AssertionError unless every step holds and the last step gives the answer."""
    for step in problem.steps:
        lhs, rhs = step.rsplit(" = ", 1)
        assert _evaluate(lhs) == _evaluate(rhs), f"{problem.template}: wrong step {step!r}"
    last = _evaluate(problem.steps[-1].rsplit(" = ", 1)[1])
    assert last == problem.answer, f"{problem.template}: last step {last} != {problem.answer}"
    shown = re.sub(r"[^\d./-]", "", problem.answer_text.split(" ")[0])
    assert _evaluate(shown) == problem.answer, f"answer text {problem.answer_text!r}"


def math_problem(seed: int, index: int) -> WordProblem:
    rng = random.Random(f"math:{seed}:{index}")
    return rng.choice(TEMPLATES)(rng)


def math_prompts(seed: int) -> Iterator[dict]:
    """Endless stream of word problems; item i depends only on (seed, i)."""
    index = 0
    while True:
        problem = math_problem(seed, index)
        rng = random.Random(f"math:{seed}:{index}:instruction")
        instruction = rng.choice(INSTRUCTIONS)
        content = (
            f"{problem.question}\n{instruction}"
            if rng.random() < 0.7
            else f"{instruction}\n\n{problem.question}"
        )
        yield {
            "domain": "math",
            "id": f"math/s{seed}/{index}/{problem.template}",
            "messages": [{"role": "user", "content": content}],
            "answer": problem.answer_text,
            "solution": problem.solution,
        }
        index += 1
