"""How a configuration that does not validate is reported: every problem, each a line starting with its
dotted key, and for a mistyped key the nearest known key at that level ("did you mean")."""

from __future__ import annotations

import difflib
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kvsidecar.errors import ConfigError


class ConfigInvalid(ConfigError):
    """KV_CONFIG_INVALID with every problem found, each a line starting with its dotted key."""

    def __init__(self, problems: list[str], *, hint: str | None = None) -> None:
        super().__init__("; ".join(problems), hint=hint)
        self.problems = tuple(problems)


def _field_type(model: type[BaseModel], name: str) -> Any:
    field = model.model_fields.get(name)
    return None if field is None else field.annotation


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X; `Annotated[X, ...]` -> X."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def known_keys(root: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The keys the section at `loc` accepts (`("servers", "local")` -> ServerConfig's fields)."""
    tp: Any = root
    rest = list(loc)
    while rest:
        tp = _unwrap(tp)
        if get_origin(tp) is dict:
            tp = get_args(tp)[1]  # the key under a dict section is the user's name (servers.<name>)
        elif isinstance(tp, type) and issubclass(tp, BaseModel):
            tp = _field_type(tp, str(rest[0]))
        else:
            return []
        rest.pop(0)
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _problem(err: Any, root: type[BaseModel]) -> list[str]:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not key:  # cross-key checks name their keys at the start of each line
        return msg.splitlines()
    if err["type"] == "extra_forbidden":
        near = difflib.get_close_matches(str(loc[-1]), known_keys(root, loc[:-1]), n=1)
        msg = "unknown key" + (f" (did you mean {near[0]!r}?)" if near else "")
    return [f"{key}: {msg}"]


def config_problems(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """Every error of a validation, `dotted.key: message`, with a suggestion for a mistyped key."""
    return [line for err in exc.errors() for line in _problem(err, root)]
