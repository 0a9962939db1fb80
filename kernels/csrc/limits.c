/* The limits of pdserve_kernels.h as data, for kernels/cpu/native.py to read from the library. */
#include "pdserve_kernels.h"

#define PDS_LIMIT_CONST(name, value) PDS_API const int64_t pds_limit_##name = value;
PDS_LIMITS(PDS_LIMIT_CONST)
