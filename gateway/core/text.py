"""Free-text checks applied at the edge, so that no string reaches the tokenizer, the
database or a JSON response that cannot be encoded.

* :data:`Text` — any valid Unicode: no lone surrogate (JSON ``"\\ud800"`` decodes to one,
  and UTF-8 cannot encode it: the tokenizer, SQLite, asyncpg and the JSON encoder all
  fail on it). NUL (U+0000) is allowed: model text (messages, prompts, stop strings)
  never reaches the database.
* :data:`Label` — :data:`Text` without NUL, at most 256 characters: stored in the
  database (``user`` on generation requests → ``request_records.user``, key labels,
  filters compared with stored columns). Postgres ``text``/``varchar`` reject U+0000.
* :data:`Name` / :data:`NameRef` (tenant and tier names) — see :func:`name_problem`.

Every failure is a pydantic error of type ``invalid_unicode`` / ``invalid_name``, which
:func:`gateway.core.errors.from_validation_error` answers as 400 ``invalid_request_error``
naming the field in ``param`` (``user``, ``stop[1]``, ``messages[0].content``). The
messages never echo the offending text (it may not be encodable).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Annotated, Callable

from pydantic import AfterValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

LABEL_MAX = 256  # request_records.user, api_keys.user_label: String(256)
NAME_MAX = 64  # sla_tiers.name: String(64) (tenants.name is 128: names created before the check)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,%d}" % (NAME_MAX - 1))
NAME_RULE = (f"1 to {NAME_MAX} characters: letters, digits, '.', '_', '@' and '-', starting with a letter or "
             "a digit")


def unicode_problem(text: str, *, allow_nul: bool = True) -> str | None:
    """Why ``text`` may not be stored or tokenized, or None when it is fine."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the text is not valid Unicode (lone surrogate U+{ord(text[exc.start]):04X} at position {exc.start})"
    if not allow_nul and "\x00" in text:
        return f"the text must not contain NUL (U+0000, at position {text.index(chr(0))})"
    return None


def name_problem(name: str, *, existing: bool = False) -> str | None:
    """Why ``name`` is not a valid tenant/tier name, or None.

    A name that creates a tenant or tier must match :data:`NAME_PATTERN` (it is a URL
    path segment of the admin API and is shown in the admin UI). With ``existing``
    (a name that only looks up a row), any storable text up to 128 characters is
    accepted, so tenants and tiers created before this check stay readable and
    manageable; a name that does not exist is then a 404 as before."""
    if existing:
        problem = unicode_problem(name, allow_nul=False)
        return problem or (None if 0 < len(name) <= 128 else "a name has 1 to 128 characters")
    return None if NAME_PATTERN.fullmatch(name) else f"a name has {NAME_RULE}"


def label_problem(text: str) -> str | None:
    """Why ``text`` may not be stored as a :data:`Label`, or None."""
    problem = unicode_problem(text, allow_nul=False)
    if problem is None and len(text) > LABEL_MAX:
        problem = f"the text has {len(text)} characters; at most {LABEL_MAX} are allowed"
    return problem


def _checked(problem_of: Callable[[str], str | None], kind: str) -> AfterValidator:
    """A pydantic validator raising a ``kind`` error whose message is ``problem_of(value)``."""

    def check(value: str) -> str:
        problem = problem_of(value)
        if problem:
            raise PydanticCustomError(kind, problem)
        return value

    return AfterValidator(check)


Text = Annotated[str, _checked(unicode_problem, "invalid_unicode")]
Label = Annotated[str, _checked(label_problem, "invalid_unicode"), WithJsonSchema({"type": "string",
                                                                                   "maxLength": LABEL_MAX})]
Name = Annotated[str, _checked(name_problem, "invalid_name"),
                 WithJsonSchema({"type": "string", "pattern": f"^{NAME_PATTERN.pattern}$", "maxLength": NAME_MAX})]
NameRef = Annotated[str, _checked(partial(name_problem, existing=True), "invalid_name")]
