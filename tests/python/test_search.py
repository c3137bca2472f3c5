"""qkv.search.SearchIndex: building, opening, querying one text or many, and
verifying an index of the test suite's 274 packages (tests/search/lists)
with the sentence encoder at QKV_SEARCH_MODEL (the venv's; a missing model
fails); every error named. The engines' rankings themselves are tested
through the command (tests/cli/test_search.py) and in C++
(tests/search/test_search_index.cc)."""

import os
import pathlib

import pytest

import qkv
import qkv.search

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LISTS = os.path.join(SOURCE, "tests", "search", "lists")


def model_dir():
    model = os.environ.get("QKV_SEARCH_MODEL", "")
    assert os.path.isfile(os.path.join(model, "model.safetensors")), \
        f"QKV_SEARCH_MODEL={model!r} is not all-MiniLM-L6-v2's directory (scripts/model-dir.sh)"
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "packages.idx"
    index = qkv.search.SearchIndex.build(path, model_dir(), lists=LISTS, document_tokens=32,
                                         epochs=1, batch=64, seed=3)
    return path, index


def test_build_and_open(built):
    path, index = built
    assert len(index) == 274
    assert repr(index) == "SearchIndex(274 packages)"
    opened = qkv.search.SearchIndex(str(path))  # str or os.PathLike
    assert opened.query("gnuplot") == index.query("gnuplot")
    index.verify()


def test_query_results(built):
    _, index = built
    for engine in ("hybrid", "learned", "bm25"):
        r = index.query("interactive plotting program", top_k=4, engine=engine)
        assert len(r) == 4
        assert set(r[0]) == {"package", "score", "section", "description"}
        assert r[0]["package"].startswith("gnuplot"), (engine, r)
        scores = [h["score"] for h in r]
        assert scores == sorted(scores, reverse=True), engine
    # The learned engine's scores are softmax weights over every package.
    weights = [h["score"] for h in index.query("plotting", top_k=274, engine="learned")]
    assert len(weights) == 274
    assert sum(weights) == pytest.approx(1.0, abs=1e-4)
    # bytes are UTF-8; a query without words has no results.
    assert index.query(b"gnuplot") == index.query("gnuplot")
    assert index.query("?!") == []


def test_query_batch_is_query_for_each(built):
    _, index = built
    texts = ["compress files", "gnuplot", "", "version control system"]
    for engine in ("hybrid", "learned", "bm25"):
        batch = index.query_batch(texts, top_k=5, engine=engine)
        assert len(batch) == 4
        assert batch[2] == []
        for text, got in zip(texts, batch):
            want = index.query(text, top_k=5, engine=engine)
            # Encoded together: the same packages first, scores to float32 roundings.
            assert [h["package"] for h in got][:2] == [h["package"] for h in want][:2], text
            for g, w in zip(got, want):
                if g["package"] == w["package"]:
                    assert g["score"] == pytest.approx(w["score"], rel=1e-5, abs=1e-7)


def test_errors_are_named(built, tmp_path):
    path, index = built
    with pytest.raises(qkv.Error, match="SearchIndex.query: top_k is 0; expected 1 to 1000"):
        index.query("x", top_k=0)
    with pytest.raises(qkv.Error, match='SearchIndex.query_batch: engine is "dense"; expected'):
        index.query_batch(["x"], engine="dense")
    with pytest.raises(TypeError, match="texts is one text"):
        index.query_batch("gnuplot")
    missing = tmp_path / "none"
    with pytest.raises(qkv.Error, match="no such index directory"):
        qkv.search.SearchIndex(missing)
    with pytest.raises(qkv.Error, match="already exists"):
        qkv.search.SearchIndex.build(path, model_dir(), lists=LISTS)
    with pytest.raises(qkv.Error, match="config.json"):
        qkv.search.SearchIndex.build(tmp_path / "i", tmp_path, lists=LISTS)
    with pytest.raises(qkv.Error, match="document_tokens is 2; expected 3 to 512"):
        qkv.search.SearchIndex.build(tmp_path / "i", model_dir(), lists=LISTS, document_tokens=2)
    with pytest.raises(qkv.Error, match="epochs is -1"):
        qkv.search.SearchIndex.build(tmp_path / "i", model_dir(), lists=LISTS, epochs=-1)
    assert not (tmp_path / "i").exists()


def test_verify_finds_a_changed_byte(built, tmp_path):
    import shutil
    path, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    head = pathlib.Path(copy, "query_head.npy")
    data = bytearray(head.read_bytes())
    data[len(data) // 2] ^= 0x20
    head.write_bytes(bytes(data))
    index = qkv.search.SearchIndex(copy)  # open() does not read every byte
    with pytest.raises(qkv.Error, match="query_head.npy: checksum .* does not match"):
        index.verify()
