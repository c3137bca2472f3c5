"""Clear errors for calls whose arguments do not fit a compiled function's signature.

pybind11 answers an unknown keyword, one argument too many or a value it
cannot convert with one wall of text ("incompatible function arguments. The
following argument types are supported: ... Invoked with: <every array
printed>") that does not say which argument is wrong. `named_errors(fn)`
wraps a function of qkv._qkv: the call goes straight through, and only when
pybind11 refuses the arguments is the refusal read against the signature it
lists, and replaced by a TypeError that names the function, the argument as
the user spelled it and the value (the nearest known keyword for a typo).
What cannot be pinned on one argument keeps pybind11's own message.
"""

import difflib
import functools
import re

_LISTED_SIGNATURE = re.compile(r"^\s*1\. (?:[\w.]*)\((.*)\)(?: -> .*)?$", re.M)


class _Parameter:
    def __init__(self, text, keyword_only):
        name, _, rest = text.partition(":")
        kind, _, default = rest.partition("=")
        self.name = name.strip()
        self.kind = kind.strip()
        self.required = not default
        self.keyword_only = keyword_only


def _split_top_level(text):
    """Splits pybind11's parameter list at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _listed_parameters(message):
    """The parameters of the one signature pybind11's refusal lists (None for
    overloads or a message of another shape)."""
    if "2. " in message.split("Invoked with:")[0]:
        return None
    match = _LISTED_SIGNATURE.search(message)
    if not match:
        return None
    parameters, keyword_only = [], False
    for text in _split_top_level(match.group(1)):
        if text == "*":
            keyword_only = True
        elif not text.startswith("*"):
            parameters.append(_Parameter(text, keyword_only))
    return parameters


def _shown(value):
    shape = getattr(value, "shape", None)
    # isinstance: a NumPy type such as np.float32 has shape and dtype too (descriptors).
    if isinstance(shape, tuple) and hasattr(value, "dtype"):
        return f"an array of shape {tuple(shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fits(kind, value):
    """Whether pybind11's caster for `kind` (as it prints it) can take `value`;
    True for kinds it takes anything as (handle, object, arrays)."""
    optional = re.fullmatch(r"Optional\[(.*)\]", kind)
    if optional:
        return value is None or _fits(optional.group(1), value)
    t = type(value)
    if kind == "float":
        return hasattr(t, "__float__") or hasattr(t, "__index__")
    if kind == "int":
        return hasattr(t, "__index__")
    if kind == "bool":
        return value is None or hasattr(t, "__bool__")
    if kind == "str":
        return isinstance(value, (str, bytes))
    return True


_KIND_NAMES = {"float": "a number", "int": "an integer", "bool": "True or False",
               "str": "a string"}


def _kind_name(kind):
    optional = re.fullmatch(r"Optional\[(.*)\]", kind)
    if optional:
        return f"{_kind_name(optional.group(1))} or None"
    return _KIND_NAMES.get(kind, kind)


def _nearest(word, words):
    close = difflib.get_close_matches(word, words, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _diagnosis(function, parameters, args, kwargs):
    """What is wrong with the call, in the user's words (None when no one
    argument is to blame)."""
    listed = [p for p in parameters if p.name != "self"]
    names = [p.name for p in parameters]
    shown_names = ", ".join(p.name for p in listed) or "no arguments"
    for key, value in kwargs.items():
        if key not in names:
            return (f"{function}: unknown argument {key}={_shown(value)}"
                    f"{_nearest(key, [p.name for p in listed])} (it takes {shown_names})")
    positional = [p for p in parameters if not p.keyword_only]
    if len(args) > len(positional):
        self_count = len(parameters) - len(listed)
        taken = len(positional) - self_count
        keyword_only = [p.name for p in parameters if p.keyword_only]
        rest = (f"; {', '.join(keyword_only)} {'is' if len(keyword_only) == 1 else 'are'} "
                "keyword-only (name=value)") if keyword_only else ""
        return (f"{function}: takes {taken} positional argument{'s' if taken != 1 else ''} "
                f"({', '.join(p.name for p in positional[self_count:])}) but was given "
                f"{len(args) - self_count}{rest}")
    given = {p.name: value for p, value in zip(positional, args)}
    for key, value in kwargs.items():
        if key in given:
            return f"{function}: {key} given twice, by position and as {key}={_shown(value)}"
        given[key] = value
    for p in parameters:
        if p.required and p.name not in given:
            required = ", ".join(q.name for q in listed if q.required)
            return f"{function}: missing argument {p.name} (required: {required})"
    for p in parameters:
        if p.name in given and not _fits(p.kind, given[p.name]):
            kind = type(given[p.name]).__name__
            article = "an" if kind[0] in "aeiou" else "a"
            return (f"{function}: {p.name} takes {_kind_name(p.kind)}, not {article} {kind}: "
                    f"{p.name}={_shown(given[p.name])}")
    return None


def named_errors(fn, qualified_name):
    """fn with pybind11's argument refusals replaced by named ones (see above)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            # An empty kwargs dict costs pybind11 0.7 us a call (2.4 -> 3.1 us
            # for a tiny attention): pass none when there are none.
            return fn(*args, **kwargs) if kwargs else fn(*args)
        except TypeError as refusal:
            message = str(refusal)
            first_line = message.split("\n", 1)[0]
            if "incompatible function arguments" in first_line:
                listed_args = args
            elif "incompatible constructor arguments" in first_line:
                listed_args = args[1:]  # the signature pybind11 lists has no self
            else:
                raise
            parameters = _listed_parameters(message)
            diagnosis = parameters is not None and _diagnosis(qualified_name, parameters, listed_args, kwargs)
            if not diagnosis:
                raise
            raise TypeError(diagnosis) from None

    return call
