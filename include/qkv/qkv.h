// The whole public API of qkv in one include.
#pragma once

#include "qkv/attention.h"
#include "qkv/dropout.h"
#include "qkv/error.h"
#include "qkv/lookup.h"
#include "qkv/masked_softmax.h"
#include "qkv/modules.h"
#include "qkv/npy.h"
#include "qkv/plot.h"
#include "qkv/pooling.h"
#include "qkv/simd.h"
#include "qkv/staged_file.h"
#include "qkv/tensor.h"
#include "qkv/threads.h"
#include "qkv/valid_lens.h"
#include "qkv/version.h"
