// The namespace of the kernels' entry points (and their torch ops): tests build an AVX2-only copy of the
// library under another name, loaded beside this one.
#pragma once

#ifndef FLAGDEPLOY_OPS_NS
#define FLAGDEPLOY_OPS_NS flagdeploy_cpu
#endif
