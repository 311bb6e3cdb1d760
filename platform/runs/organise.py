"""Organising runs: tags and a note on each, and the filters of the runs list.

`check_*` validate and raise `InvalidInput` naming the field or query parameter; `do_organise_run`
changes a run's tags and note; `filter_runs` narrows a queryset by the list's query parameters
(`?search=&tag=&status=&recipe=&project=&layout=`), which the dashboard keeps in its URL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import QueryDict

from controlplane.exceptions import InvalidInput
from runs.models import Project, Run, RunTag
from training.config import RECIPES

# Tags are labels to filter by, not prose: short, lower case, no spaces, so `?tag=` in a URL
# needs no escaping and "Baseline" and "baseline" are never two tags.
TAG_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.:-]{0,31}")
TAG_RULE = "1 to 32 characters: lower-case letters, digits and - _ . : (starting with a letter or digit)"
# What the API schema states (drf-spectacular), built from TAG_PATTERN: a tag in a PATCH, as it is
# (no white space around it), and a `?tag=` value, which holds one or more comma-separated tags,
# each trimmed, empty ones skipped (`_values`). The white space is what str.strip() removes, spelled
# out: a schema's regex is ECMA's, whose \s is not quite Python's.
TAG_SCHEMA_PATTERN = f"^{TAG_PATTERN.pattern}$"
_SPACE = "[" + "".join(f"\\u{ord(c):04x}" for c in map(chr, range(0x3001)) if c.isspace()) + "]"


def list_pattern(item: str) -> str:
    """The regex of a query value `_values` reads: items matching `item`, comma-separated."""
    one = rf"{_SPACE}*(?:(?:{item}){_SPACE}*)?"
    return rf"^{one}(?:,{one})*$"


TAG_FILTER_PATTERN = list_pattern(TAG_PATTERN.pattern)
STATUS_FILTER_PATTERN = list_pattern("|".join(re.escape(status) for status in Run.Status.values))
MAX_TAGS = 16
MAX_TAG_LENGTH = 32
MAX_NOTE = 10_000
MAX_SEARCH = 200
# A degree past this is no layout any cluster runs; refusing it keeps the number a database integer.
MAX_DEGREE = 65_536
LAYOUT_DIMS = ("dp", "tp", "pp")
LAYOUT_PART = re.compile(r"(dp|tp|pp)([1-9][0-9]*)")
LAYOUT_TRIPLE = re.compile(r"([1-9][0-9]*)[x×]([1-9][0-9]*)[x×]([1-9][0-9]*)")
LAYOUT_RULE = (
    "a layout such as dp2-tp2-pp1 (any of dp, tp, pp with a degree, joined by '-'; the ones left out "
    "match any degree) or 2x2x1 (dp x tp x pp)"
)


def check_tag(value: str, field: str = "tags") -> str:
    if not TAG_PATTERN.fullmatch(value):
        raise InvalidInput(field, f"a tag is {TAG_RULE}; got {value!r}")
    return value


def check_tags(values: Iterable[str]) -> list[str]:
    """The tags to keep, in the order given, each once."""
    tags = list(dict.fromkeys(check_tag(v) for v in values))
    if len(tags) > MAX_TAGS:
        raise InvalidInput("tags", f"a run has at most {MAX_TAGS} tags; got {len(tags)}")
    return tags


def do_organise_run(run: Run, *, tags: list[str] | None = None, note: str | None = None) -> Run:
    """Replaces the run's tags and/or note (None leaves one as it is). Tags are checked here."""
    checked = check_tags(tags) if tags is not None else None
    if note is not None and len(note) > MAX_NOTE:
        raise InvalidInput("note", f"at most {MAX_NOTE} characters; got {len(note)}")
    with transaction.atomic():
        if note is not None:
            Run.objects.filter(pk=run.pk).update(note=note)
        if checked is not None:
            RunTag.objects.filter(run=run).exclude(name__in=checked).delete()
            kept = set(RunTag.objects.filter(run=run).values_list("name", flat=True))
            RunTag.objects.bulk_create([RunTag(run=run, name=name) for name in checked if name not in kept])
    return Run.objects.prefetch_related("tags").get(pk=run.pk)


def do_move_run(run: Run, project: Project | None) -> None:
    """Puts the run in a project (its members then see it), or takes it out (None).
    `access.check_project_for` decides whether the caller may."""
    Run.objects.filter(pk=run.pk).update(project=project)


def check_layout(raw: str) -> dict[str, int]:
    """`dp2-tp2-pp1`, `tp4`, or `2x2x1` → the degrees asked for, by dimension."""
    value = raw.strip().lower()
    triple = LAYOUT_TRIPLE.fullmatch(value)
    if triple:
        degrees = dict(zip(LAYOUT_DIMS, (int(g) for g in triple.groups()), strict=True))
    else:
        degrees = {}
        for part in value.split("-"):
            match = LAYOUT_PART.fullmatch(part)
            if match is None or match.group(1) in degrees:
                raise InvalidInput("layout", f"must be {LAYOUT_RULE}; got {raw!r}")
            degrees[match.group(1)] = int(match.group(2))
    if any(d > MAX_DEGREE for d in degrees.values()):
        raise InvalidInput("layout", f"a degree is at most {MAX_DEGREE}; got {raw!r}")
    return degrees


def _values(params: QueryDict, name: str) -> list[str]:
    """A parameter given once with commas (`?tag=a,b`) or repeated (`?tag=a&tag=b`)."""
    return [v.strip() for raw in params.getlist(name) for v in raw.split(",") if v.strip()]


def filter_runs(runs: QuerySet[Run], params: QueryDict) -> QuerySet[Run]:
    """The runs that match every filter given: `search` (in the name or the note, any case),
    each `tag`, any of the `status`es, the `recipe`, the `project`, the `layout`."""
    if search := params.get("search", "").strip():
        if len(search) > MAX_SEARCH:
            raise InvalidInput("search", f"at most {MAX_SEARCH} characters; got {len(search)}")
        runs = runs.filter(Q(name__icontains=search) | Q(note__icontains=search))
    tags = sorted({check_tag(tag, "tag") for tag in _values(params, "tag")})
    if len(tags) > MAX_TAGS:
        # (Each is a join: SQLite refuses more than 64 tables in one, and no run could match.)
        raise InvalidInput("tag", f"a run has at most {MAX_TAGS} tags, so at most {MAX_TAGS} filter runs; got {len(tags)}")
    for tag in tags:
        runs = runs.filter(tags__name=tag)
    if statuses := _values(params, "status"):
        unknown = [s for s in statuses if s not in Run.Status.values]
        if unknown:
            raise InvalidInput("status", f"must be among {', '.join(Run.Status.values)}; got {unknown[0]!r}")
        runs = runs.filter(status__in=statuses)
    if recipe := params.get("recipe", "").strip():
        if recipe not in RECIPES:
            raise InvalidInput("recipe", f"must be one of {', '.join(RECIPES)}; got {recipe!r}")
        runs = runs.filter(recipe=recipe)
    if project := params.get("project", "").strip():
        if not project.isdigit() or len(project) > 18:
            raise InvalidInput("project", f"must be a project id; got {project!r}")
        runs = runs.filter(project_id=int(project))
    if layout := params.get("layout", "").strip():
        for dim, degree in check_layout(layout).items():
            # Stored specs are resolved, so every run's spec names all three degrees.
            runs = runs.filter(**{f"spec__layout__{dim}": degree})
    return runs
