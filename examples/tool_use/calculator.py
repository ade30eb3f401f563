"""A slow calculator tool: safe arithmetic (no eval), answered after `latency_s` like a remote tool call would be."""

from __future__ import annotations

import ast
import asyncio
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message goes back to the model."""


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 16 or abs(left) > 10**6):
            raise CalculatorError("power too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("result out of range")
        return value
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses); `CalculatorError` otherwise."""
    text = expression.strip().rstrip("=?. ").replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {text[:40]!r}") from None
    return _eval(tree.body)


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


async def calculator(expression: str, latency_s: float) -> str:
    """The tool: the expression's value as text, or 'error: ...', after `latency_s` seconds (a slow remote tool)."""
    await asyncio.sleep(latency_s)
    try:
        return format_value(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"
