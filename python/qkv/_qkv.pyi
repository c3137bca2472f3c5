"""Type stubs of qkv._qkv, the compiled half of the qkv package (re-exported by qkv).

Shapes follow d2l: queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv);
2-D arrays are a batch of one. Arrays are float32 or float64 (one dtype per
call); valid lengths are integers. help(qkv.<name>) has the full docstrings.
"""

import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating[Any]]
ArrayLike = npt.ArrayLike
ValidLens = Optional[ArrayLike]
Bandwidth = Union[float, Sequence[float], npt.NDArray[np.floating[Any]], str]

__version__: str

class Error(ValueError):
    """Bad arguments or input (qkv::Error); the message names the function, argument and shapes."""

class IoError(OSError):
    """The system failed a call whose arguments were fine (qkv::IoError)."""

class ScaledDotProductAttentionGrads(NamedTuple):
    d_queries: FloatArray
    d_keys: FloatArray
    d_values: FloatArray

class ScaledDotProductAttentionBiasGrads(NamedTuple):
    d_queries: FloatArray
    d_keys: FloatArray
    d_values: FloatArray
    d_bias: FloatArray

class MergedAttention(NamedTuple):
    output: FloatArray
    lse: FloatArray

class AdditiveAttentionGrads(NamedTuple):
    d_queries: FloatArray
    d_keys: FloatArray
    d_values: FloatArray
    d_W_q: FloatArray
    d_W_k: FloatArray
    d_w_v: FloatArray

class BilinearAttentionGrads(NamedTuple):
    d_queries: FloatArray
    d_keys: FloatArray
    d_values: FloatArray
    d_W: FloatArray

# ---- runtime ----
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def simd_targets() -> list[str]: ...
def simd_target() -> str: ...
def set_simd_target(name: str) -> None: ...
def simd_info() -> dict[str, Any]: ...

# ---- masked softmax ----
def masked_softmax(X: ArrayLike, valid_lens: ValidLens = None) -> FloatArray: ...
def masked_softmax_backward(
    weights: ArrayLike, d_weights: ArrayLike, valid_lens: ValidLens = None
) -> FloatArray: ...

# ---- attention ----
def scaled_dot_product_attention(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    scale: Optional[float] = None,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    causal: Optional[str] = None,
    out: Optional[FloatArray] = None,
    mask: Optional[ArrayLike] = None,
    key_mask: Optional[ArrayLike] = None,
    window: Optional[Tuple[int, int]] = None,
    bias: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    return_softmax_stats: bool = False,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> Union[FloatArray, Tuple[FloatArray, ...]]: ...
def scaled_dot_product_attention_backward(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    output: ArrayLike,
    lse: ArrayLike,
    d_output: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    scale: Optional[float] = None,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    causal: Optional[str] = None,
    mask: Optional[ArrayLike] = None,
    key_mask: Optional[ArrayLike] = None,
    window: Optional[Tuple[int, int]] = None,
    bias: Optional[ArrayLike] = None,
    bias_grad: bool = True,
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    d_lse: Optional[ArrayLike] = None,
    softmax_stats: Optional[ArrayLike] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> Union[ScaledDotProductAttentionGrads, ScaledDotProductAttentionBiasGrads]: ...
def additive_attention(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    W_q: ArrayLike,
    W_k: ArrayLike,
    w_v: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> Union[FloatArray, Tuple[FloatArray, ...]]: ...
def additive_attention_backward(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    W_q: ArrayLike,
    W_k: ArrayLike,
    w_v: ArrayLike,
    output: ArrayLike,
    lse: ArrayLike,
    d_output: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> AdditiveAttentionGrads: ...
def bilinear_attention(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    W: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> Union[FloatArray, Tuple[FloatArray, ...]]: ...
def bilinear_attention_backward(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    W: ArrayLike,
    output: ArrayLike,
    lse: ArrayLike,
    d_output: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> BilinearAttentionGrads: ...
def distance_attention(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    scale: Optional[float] = None,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> Union[FloatArray, Tuple[FloatArray, ...]]: ...
def distance_attention_backward(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    output: ArrayLike,
    lse: ArrayLike,
    d_output: ArrayLike,
    valid_lens: ValidLens = None,
    *,
    scale: Optional[float] = None,
    dropout_p: Optional[float] = None,
    seed: Optional[int] = None,
    causal: Optional[str] = None,
    dropout: Optional[float] = None,  # deprecated: dropout_p
) -> ScaledDotProductAttentionGrads: ...

# ---- pooling with given weights ----
def attention_pooling(weights: ArrayLike, values: ArrayLike) -> FloatArray: ...
def average_pooling(
    values: ArrayLike, num_queries: int, valid_lens: ValidLens = None
) -> FloatArray: ...
def one_hot_lookup(index: ArrayLike, values: ArrayLike) -> FloatArray: ...
def one_hot_weights(index: ArrayLike, num_keys: int) -> npt.NDArray[np.float32]: ...
def uniform_weights(
    batch: int, num_queries: int, num_keys: int, valid_lens: ValidLens = None
) -> npt.NDArray[np.float32]: ...

# ---- merging attention over parts of a key set ----
def merge_attention(
    outputs: Sequence[ArrayLike], lses: Sequence[ArrayLike]
) -> MergedAttention: ...

# ---- Nadaraya-Watson ----
def nadaraya_watson(
    x_train: ArrayLike,
    y_train: ArrayLike,
    x_query: ArrayLike,
    *,
    kernel: str = "gaussian",
    bandwidth: Bandwidth = 1.0,
    exact: bool = False,
) -> npt.NDArray[np.float64]: ...

class KernelRegression:
    def __init__(self, kernel: str = "gaussian", bandwidth: Bandwidth = 1.0) -> None: ...
    def fit(self, x: ArrayLike, y: ArrayLike) -> "KernelRegression": ...
    def predict(self, x_query: ArrayLike, exact: bool = False) -> npt.NDArray[np.float64]: ...
    def weights(self, x_query: ArrayLike) -> npt.NDArray[np.float64]: ...
    def loo_error(self, bandwidth: Optional[Union[float, Sequence[float]]] = None) -> float: ...
    @property
    def kernel(self) -> str: ...
    @property
    def bandwidth(self) -> Union[float, npt.NDArray[np.float64], str]: ...
    @property
    def bandwidth_(self) -> npt.NDArray[np.float64]: ...
    @property
    def cv_loo_error_(self) -> Optional[float]: ...
    @property
    def cv_iterations_(self) -> Optional[int]: ...
    @property
    def n_features_in_(self) -> int: ...

def silverman_bandwidth(x: ArrayLike) -> npt.NDArray[np.float64]: ...
def scott_bandwidth(x: ArrayLike) -> npt.NDArray[np.float64]: ...
def train_parametric(
    x: ArrayLike,
    y: ArrayLike,
    *,
    epochs: int = 5,
    lr: float = 0.5,
    initial_w: Optional[float] = None,
    seed: int = 0,
) -> Tuple[float, npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...

# ---- the on-disk key-value store and its index ----
StrPath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

class StoreAttentionResult(NamedTuple):
    output: npt.NDArray[np.float32]
    lse: npt.NDArray[np.float32]
    top_ids: npt.NDArray[np.int64]
    top_weights: npt.NDArray[np.float32]

class IndexAttentionResult(NamedTuple):
    output: npt.NDArray[np.float32]
    lse: npt.NDArray[np.float32]
    certificate: npt.NDArray[np.float64]
    lists_visited: npt.NDArray[np.int64]
    rows_visited: npt.NDArray[np.int64]
    top_ids: npt.NDArray[np.int64]
    top_weights: npt.NDArray[np.float32]
    top_certified: npt.NDArray[np.bool_]

class KeyValueStore:
    @staticmethod
    def create(
        dir: StrPath,
        keys: ArrayLike,
        values: ArrayLike,
        *,
        dtype: str = "float32",
        chunk_rows: int = 262144,
    ) -> "KeyValueStore": ...
    @staticmethod
    def open(dir: StrPath, *, check: str = "checksums") -> "KeyValueStore": ...
    def append(self, keys: ArrayLike, values: ArrayLike) -> None: ...
    def verify(self) -> None: ...
    def keys(self, start: int = 0, stop: Optional[int] = None) -> npt.NDArray[np.float32]: ...
    def values(self, start: int = 0, stop: Optional[int] = None) -> npt.NDArray[np.float32]: ...
    def attend(
        self,
        queries: ArrayLike,
        valid_lens: ValidLens = None,
        *,
        scoring: str = "dot",
        scale: Optional[float] = None,
        bandwidth: Optional[float] = None,
        top_k: int = 0,
    ) -> StoreAttentionResult: ...
    @property
    def dir(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def key_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def chunk_rows(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...

class Index:
    @staticmethod
    def build(
        store: KeyValueStore,
        dir: StrPath,
        *,
        lists: int = 0,
        iterations: int = 10,
        seed: int = 0,
        sample_per_list: int = 64,
    ) -> "Index": ...
    @staticmethod
    def open(dir: StrPath, *, check: str = "structure") -> "Index": ...
    def verify(self) -> None: ...
    def check_built_over(self, store: KeyValueStore) -> None: ...
    @staticmethod
    def update(dir: StrPath, store: KeyValueStore) -> "Index": ...
    def attend(
        self,
        queries: ArrayLike,
        *,
        scoring: str = "dot",
        scale: Optional[float] = None,
        epsilon: Optional[float] = None,
        probe: int = 0,
        top_k: int = 0,
        kernel: str = "gaussian",
        bandwidth: Optional[float] = None,
    ) -> IndexAttentionResult: ...
    def attend_backward(
        self,
        queries: ArrayLike,
        forward: IndexAttentionResult,
        d_output: ArrayLike,
        *,
        scoring: str = "dot",
        scale: Optional[float] = None,
        epsilon: Optional[float] = None,
        probe: int = 0,
    ) -> npt.NDArray[np.float32]: ...
    @property
    def dir(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def key_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def num_lists(self) -> int: ...
    @property
    def list_rows(self) -> npt.NDArray[np.int64]: ...
    @property
    def radii(self) -> npt.NDArray[np.float64]: ...
    @property
    def max_norms(self) -> npt.NDArray[np.float64]: ...
    @property
    def centroids(self) -> npt.NDArray[np.float32]: ...
    @property
    def box_low(self) -> npt.NDArray[np.float32]: ...
    @property
    def box_high(self) -> npt.NDArray[np.float32]: ...

# qkv.torch's bf16 path (int16 bits in, float32 out); not part of the public API.
def _scaled_dot_product_attention_bf16(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    valid_lens: ValidLens,
    scale: Optional[float],
    dropout_p: float,
    seed: int,
    return_weights: bool,
    return_lse: bool,
    causal: Optional[str],
    mask: Optional[ArrayLike],
    key_mask: Optional[ArrayLike],
    window: Optional[Tuple[int, int]],
    bias: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    return_softmax_stats: bool = False,
) -> Tuple[FloatArray, Optional[FloatArray], Optional[FloatArray], Optional[FloatArray]]: ...
def _scaled_dot_product_attention_bf16_backward(
    queries: ArrayLike,
    keys: ArrayLike,
    values: ArrayLike,
    output: ArrayLike,
    lse: ArrayLike,
    d_output: ArrayLike,
    valid_lens: ValidLens,
    scale: Optional[float],
    dropout_p: float,
    seed: int,
    causal: Optional[str],
    mask: Optional[ArrayLike],
    key_mask: Optional[ArrayLike],
    window: Optional[Tuple[int, int]],
    bias: Optional[ArrayLike] = None,
    bias_grad: bool = True,
    softcap: float = 0.0,
    alibi_slopes: Optional[ArrayLike] = None,
    d_lse: Optional[ArrayLike] = None,
    softmax_stats: Optional[ArrayLike] = None,
) -> Tuple[FloatArray, FloatArray, FloatArray, Optional[FloatArray]]: ...

# The submodule qkv._qkv.search (re-exported as qkv.search).
Text = Union[str, bytes, bytearray]

class _Search:
    class Tokenizer:
        def __init__(self, vocab_path: StrPath) -> None: ...
        def encode(self, text: Text, max_length: int = 256) -> list[int]: ...
        def encode_batch(self, texts: Sequence[Text], max_length: int = 256) -> list[list[int]]: ...
        def tokens(self, text: Text) -> list[str]: ...
        def words(self, text: Text) -> list[str]: ...
        @property
        def vocab_size(self) -> int: ...
        @property
        def pad_id(self) -> int: ...
        @property
        def unk_id(self) -> int: ...
        @property
        def cls_id(self) -> int: ...
        @property
        def sep_id(self) -> int: ...
    class Encoder:
        def __init__(self, model_dir: StrPath) -> None: ...
        def encode(self, texts: Sequence[Text], max_length: int = 0) -> FloatArray: ...
        def encode_ids(self, ids: Sequence[Sequence[int]]) -> FloatArray: ...
        @property
        def tokenizer(self) -> "_Search.Tokenizer": ...
        @property
        def hidden_size(self) -> int: ...
        @property
        def max_seq_length(self) -> int: ...
    class SearchIndex:
        def __init__(self, path: StrPath) -> None: ...
        @staticmethod
        def build(path: StrPath, model: StrPath, *, lists: Optional[StrPath] = None,
                  document_tokens: int = 128, epochs: int = 4, batch: int = 1024,
                  seed: int = 0) -> "_Search.SearchIndex": ...
        def query(self, text: Text, top_k: int = 10,
                  engine: str = "hybrid") -> list[dict[str, Any]]: ...
        def query_batch(self, texts: Sequence[Text], top_k: int = 10,
                        engine: str = "hybrid") -> list[list[dict[str, Any]]]: ...
        def verify(self) -> None: ...
        def __len__(self) -> int: ...

search: _Search
