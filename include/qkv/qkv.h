// The public API of the kernels and ops (target qkv::qkv) in one include;
// the chapter's extras, figures and the name lookup, are qkv/chapter.h
// (target qkv::chapter).
#pragma once

#include "qkv/attention.h"
#include "qkv/dropout.h"
#include "qkv/error.h"
#include "qkv/index.h"
#include "qkv/linear.h"
#include "qkv/masked_softmax.h"
#include "qkv/merge.h"
#include "qkv/modules.h"
#include "qkv/npy.h"
#include "qkv/pooling.h"
#include "qkv/print.h"
#include "qkv/scoring.h"
#include "qkv/simd.h"
#include "qkv/staged_file.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "qkv/tensor.h"
#include "qkv/threads.h"
#include "qkv/valid_lens.h"
#include "qkv/version.h"
