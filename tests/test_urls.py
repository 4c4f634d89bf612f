"""The checkpoint URL rule (`distfn.checkpoint.urls`, issue 41): every URL a user passes, every key distfn derives
and every name a listing returns is either canonical and inside its prefix, or a `CheckpointError` naming the URL.
Never another exception, never a segment that climbs out (docs/threats.md, "Paths")."""

from __future__ import annotations

import re

import pytest

from distfn.checkpoint import urls
from distfn.errors import CheckpointError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.quick

SEGMENTS = st.sampled_from(["run", "ckpt-1", "", ".", "..", "%2e%2e", "%2F", "a\\b", "x\x00y", "\x7f", "\ud800",
                            "last.safetensors", "é", " ", "~", "a?versionId=1", "x#y", "\u202egpj",
                            "user:pw@b", "b:9000"])


@pytest.mark.parametrize(("url", "canonical"), [
    ("S3://bucket/run/ckpt-1", "s3://bucket/run/ckpt-1"),
    ("s3://bucket//run/./ckpt-1/", "s3://bucket/run/ckpt-1"),
    ("MEMORY://run//./x/", "memory:///run/x"),
    ("file:///tmp/run/", "file:///tmp/run"),
])
def test_equal_urls_have_one_canonical_form(url: str, canonical: str) -> None:
    assert urls.parse(url).text == canonical


@pytest.mark.parametrize("url", [
    "s3://bucket/run/../other", "s3://bucket/%2e%2e/x", "s3://bucket/a%2Fb", "s3://bucket/a\\b",
    "s3://bucket/a\x01b", "s3://", "file://tmp/x", "s3://bucket/" + "k" * 2000, "not a url",
    "s3:///run", "s3://./run", "s3://b/run?versionId=1/x", "s3://b/run#x", "gs://b/\u202ecod.exe",
    "s3://user:pw@b/run", "s3://b:9000/run", "s3://b?x=1/run",
])
def test_a_url_that_could_leave_its_prefix_is_refused_naming_it(url: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        urls.parse(url)
    assert repr(url)[:40] in str(caught.value) or "URL" in str(caught.value)


@settings(max_examples=300, deadline=None)
@given(scheme=st.sampled_from(["s3", "S3", "s3a", "gs", "file", "memory", "MeMoRy"]),
       segments=st.lists(st.one_of(SEGMENTS, st.text(max_size=6)), max_size=6),
       slash=st.booleans())
def test_any_url_is_canonical_and_inside_or_a_checkpoint_error(scheme: str, segments: list[str],
                                                              slash: bool) -> None:
    url = f"{scheme}://{'/' if slash else ''}" + "/".join(segments)
    try:
        parsed = urls.parse(url)
    except CheckpointError:
        return
    assert parsed.scheme == scheme.lower()
    assert all(part not in ("", ".", "..") for part in parsed.parts)
    assert all(urls.name_problem(part) is None for part in parsed.parts)
    assert urls.parse(parsed.text) == parsed  # canonical: parsing the canonical form changes nothing
    assert not any(set(part) & set("?#\u202e") for part in parsed.parts)  # nothing a layer below reads otherwise
    if not parsed.rooted:  # the bucket is the first segment written, never a key moved up into its place
        assert parsed.parts[0] == url.split("://", 1)[1].split("/")[0]


@settings(max_examples=300, deadline=None)
@given(name=st.one_of(SEGMENTS, st.text(max_size=12)))
def test_a_listed_name_that_passes_is_one_entry_inside_its_directory(name: str) -> None:
    if urls.name_problem(name) is None:
        assert name not in ("", ".", "..") and "/" not in name and "\\" not in name
        assert re.search("%[0-9A-Fa-f]{2}", name) is None  # never an escape a server could decode
