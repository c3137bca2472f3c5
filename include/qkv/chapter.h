// The chapter's extras in one include (target qkv::chapter, library
// qkv_chapter): the gnuplot figures (qkv/plot.h, which spawn gnuplot) and the
// key-value name lookup of d2l 11.1 (qkv/lookup.h). The kernels and ops are
// qkv/qkv.h (target qkv::qkv), which links no process-spawning code.
#pragma once

#include "qkv/lookup.h"
#include "qkv/plot.h"
