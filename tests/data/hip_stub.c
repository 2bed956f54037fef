/* A stand-in for libamdhip64 with host memory, so the loader's HIP branch runs
 * without an AMD GPU: tests/test_kernels_loader.py compiles it and points
 * PAGEDKV_HIP_LIBRARY at it. Environment knobs (read at each call):
 * STUB_INIT_ERROR=<code> makes hipInit fail, STUB_DEVICE_COUNT=<n> sets the count,
 * STUB_DEVICE_NAME / STUB_ARCH_NAME set the device name and hipDeviceProp_t.gcnArchName.
 * Launches are recorded (grid, block, shared bytes, parameter bytes) for the test
 * to read back through stub_last_launch(); stub_launch_count() counts them.
 *
 * Kernels run nothing, except the pool's byte movers (pkv_copy_blocks_{16,1},
 * pkv_slabs_{gather,scatter}), which are emulated on host memory with the
 * kernels' semantics so the device pool's bookkeeping (growth, token scatter and
 * gather, block I/O) can be tested end to end without a GPU. Their device code is
 * tested on a GPU (tests/test_device_pool.py, marked gpu). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t;
enum { OK = 0, E_INVALID_VALUE = 1, E_OOM = 2, E_INVALID_IMAGE = 200, E_NOT_FOUND = 500 };

const char *hipGetErrorName(hipError_t e) {
  switch (e) {
    case 0: return "hipSuccess";
    case 1: return "hipErrorInvalidValue";
    case 2: return "hipErrorOutOfMemory";
    case 100: return "hipErrorNoDevice";
    case 200: return "hipErrorInvalidImage";
    case 500: return "hipErrorNotFound";
    default: return "hipErrorUnknown";
  }
}
const char *hipGetErrorString(hipError_t e) {
  switch (e) {
    case 2: return "out of memory";
    case 100: return "no ROCm-capable device is detected";
    case 200: return "device kernel image is invalid";
    case 500: return "named symbol not found";
    default: return "stub error";
  }
}

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v ? atoi(v) : dflt;
}
static const char *env_str(const char *name, const char *dflt) {
  const char *v = getenv(name);
  return v ? v : dflt;
}
#define DEVICE_NAME() env_str("STUB_DEVICE_NAME", "pagedkv HIP stub")

hipError_t hipInit(unsigned flags) { (void)flags; return env_int("STUB_INIT_ERROR", 0); }
hipError_t hipDriverGetVersion(int *v) { *v = 50221153; return OK; }
hipError_t hipGetDeviceCount(int *n) { *n = env_int("STUB_DEVICE_COUNT", 1); return OK; }
hipError_t hipSetDevice(int d) { return d == 0 ? OK : 101; }
hipError_t hipDeviceGetName(char *name, int len, int dev) {
  (void)dev;
  strncpy(name, DEVICE_NAME(), (size_t)len);
  return OK;
}
hipError_t hipDeviceGetAttribute(int *out, int attr, int dev) {
  (void)dev;
  switch (attr) {
    case 63: *out = 110; return OK;       /* multiprocessors */
    case 19: *out = 8 << 20; return OK;   /* L2 bytes */
    case 87: *out = 64; return OK;        /* warp size */
    case 74: *out = 65536; return OK;     /* shared memory per block */
    default: return E_INVALID_VALUE;
  }
}
hipError_t hipDeviceTotalMem(size_t *bytes, int dev) { (void)dev; *bytes = (size_t)64 << 30; return OK; }
/* The ROCm 5 layout (ROCm 6's hipDeviceProp_tR0000): name at 0, gcnArchName at 396. */
hipError_t hipGetDeviceProperties(void *props, int dev) {
  (void)dev;
  strncpy((char *)props, DEVICE_NAME(), 255);
  strncpy((char *)props + 396, env_str("STUB_ARCH_NAME", "gfx90a:sramecc+:xnack-"), 255);
  return OK;
}
hipError_t hipDeviceSynchronize(void) { return OK; }

hipError_t hipMalloc(void **p, size_t n) {
  if (n > ((size_t)1 << 40)) return E_OOM;
  *p = malloc(n);
  return *p ? OK : E_OOM;
}
hipError_t hipFree(void *p) { free(p); return OK; }
hipError_t hipMemcpyHtoD(void *d, const void *s, size_t n) { memcpy(d, s, n); return OK; }
hipError_t hipMemcpyDtoH(void *d, const void *s, size_t n) { memcpy(d, s, n); return OK; }
hipError_t hipMemcpyDtoD(void *d, const void *s, size_t n) { memcpy(d, s, n); return OK; }
hipError_t hipMemcpyDtoDAsync(void *d, const void *s, size_t n, void *st) {
  (void)st; memcpy(d, s, n); return OK;
}
hipError_t hipMemsetD8(void *d, unsigned char v, size_t n) { memset(d, v, n); return OK; }
hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
  *free_bytes = (size_t)env_int("STUB_FREE_MIB", 48 << 10) << 20;
  *total = (size_t)64 << 30;
  return OK;
}

static int module_token;
hipError_t hipModuleLoadData(void **mod, const void *image) {
  /* A code object is an ELF file or a clang offload bundle of them. */
  if (memcmp(image, "\x7f" "ELF", 4) != 0 && memcmp(image, "__CLANG_OFFLOAD_BUNDLE__", 24) != 0)
    return E_INVALID_IMAGE;
  *mod = &module_token;
  return OK;
}
hipError_t hipModuleUnload(void *mod) { (void)mod; return OK; }

/* A function handle points at its name, interned: a name keeps its slot for the life of
 * the process, so a handle looked up long ago still names the same kernel. */
#define MAX_FUNCTIONS 512
static char function_names[MAX_FUNCTIONS][128];
static int n_functions;
hipError_t hipModuleGetFunction(void **fn, void *mod, const char *name) {
  if (mod != &module_token || strncmp(name, "pkv_", 4) != 0) return E_NOT_FOUND;
  for (int i = 0; i < n_functions; ++i) {
    if (strncmp(function_names[i], name, 127) == 0) {
      *fn = function_names[i];
      return OK;
    }
  }
  if (n_functions == MAX_FUNCTIONS) return E_OOM;
  strncpy(function_names[n_functions], name, 127);
  *fn = function_names[n_functions++];
  return OK;
}

/* The last launch: function name, grid, block, shared bytes, each parameter's bytes
 * (sizes set by the test through stub_set_param_sizes, for the next launch only) and the
 * stream handle. */
struct launch_record {
  char name[128];
  unsigned grid[3], block[3], shared_bytes;
  int n_params;
  uint8_t params[32][8];
  void *stream;
};
static struct launch_record last;
static long launch_count;
long stub_launch_count(void) { return launch_count; }

/* hip/kvcache.hip pkv_copy_blocks_*: block src_ids[i] of src to block dst_ids[i] of dst. */
static void emulate_copy_blocks(void **params) {
  const uint8_t *src = *(const uint8_t **)params[0];
  const int32_t *src_ids = *(const int32_t **)params[1];
  const int32_t *dst_ids = *(const int32_t **)params[2];
  uint8_t *dst = *(uint8_t **)params[3];
  const int n = *(const int *)params[4];
  const int64_t bytes = *(const int64_t *)params[5];
  for (int i = 0; i < n; ++i)
    memmove(dst + (int64_t)dst_ids[i] * bytes, src + (int64_t)src_ids[i] * bytes, (size_t)bytes);
}

/* hip/pool.hip pkv_slabs_gather / _scatter: slab i of a staging buffer <-> the bytes at
 * bases[i] + offset. */
static void emulate_slabs(void **params, int gather) {
  const uint64_t *bases = *(const uint64_t **)params[gather ? 0 : 1];
  uint8_t *staging = *(uint8_t **)params[gather ? 1 : 0];
  const int n = *(const int *)params[2];
  const int64_t offset = *(const int64_t *)params[3];
  const int64_t bytes = *(const int64_t *)params[4];
  for (int i = 0; i < n; ++i) {
    uint8_t *pool = (uint8_t *)(uintptr_t)bases[i] + offset;
    if (gather) memcpy(staging + (int64_t)i * bytes, pool, (size_t)bytes);
    else memcpy(pool, staging + (int64_t)i * bytes, (size_t)bytes);
  }
}
static int param_sizes[32];
static int n_param_sizes;
void stub_set_param_sizes(int n, const int *sizes) {
  n_param_sizes = n;
  memcpy(param_sizes, sizes, sizeof(int) * (size_t)n);
}
const struct launch_record *stub_last_launch(void) { return &last; }

hipError_t hipModuleLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shared, void *stream,
                                 void **params, void **extra) {
  (void)extra;
  strncpy(last.name, (const char *)fn, 127);
  last.stream = stream;
  last.grid[0] = gx; last.grid[1] = gy; last.grid[2] = gz;
  last.block[0] = bx; last.block[1] = by; last.block[2] = bz;
  last.shared_bytes = shared;
  last.n_params = n_param_sizes;
  memset(last.params, 0, sizeof last.params);
  for (int i = 0; i < n_param_sizes; ++i) memcpy(last.params[i], params[i], (size_t)param_sizes[i]);
  n_param_sizes = 0;  /* sizes describe one kernel: the next launch may take fewer params */
  ++launch_count;
  if (strncmp(last.name, "pkv_copy_blocks_", 16) == 0) emulate_copy_blocks(params);
  else if (strcmp(last.name, "pkv_slabs_gather") == 0) emulate_slabs(params, 1);
  else if (strcmp(last.name, "pkv_slabs_scatter") == 0) emulate_slabs(params, 0);
  return OK;
}

static int stream_token, event_token;
hipError_t hipStreamCreateWithFlags(void **s, unsigned f) { (void)f; *s = &stream_token; return OK; }
hipError_t hipStreamSynchronize(void *s) { (void)s; return OK; }
hipError_t hipStreamDestroy(void *s) { (void)s; return OK; }
hipError_t hipEventCreateWithFlags(void **e, unsigned f) { (void)f; *e = &event_token; return OK; }
hipError_t hipEventRecord(void *e, void *s) { (void)e; (void)s; return OK; }
hipError_t hipEventSynchronize(void *e) { (void)e; return OK; }
hipError_t hipEventElapsedTime(float *ms, void *a, void *b) { (void)a; (void)b; *ms = 0.5f; return OK; }
hipError_t hipEventDestroy(void *e) { (void)e; return OK; }
static void *last_wait_stream;
hipError_t hipStreamWaitEvent(void *s, void *e, unsigned f) {
  (void)e; (void)f; last_wait_stream = s; return OK;
}
void *stub_last_wait_stream(void) { return last_wait_stream; }

/* Graphs: a capture records nothing (launches inside it are recorded as usual) and
 * launching the instantiated graph does nothing; its node count is the launches made
 * during the last capture. */
static int graph_token, graph_exec_token;
static long capture_start, captured_launches;
hipError_t hipStreamBeginCapture(void *s, int mode) {
  (void)s; (void)mode; capture_start = launch_count; return OK;
}
hipError_t hipStreamEndCapture(void *s, void **g) {
  (void)s; *g = &graph_token; captured_launches = launch_count - capture_start; return OK;
}
hipError_t hipGraphGetNodes(void *g, void **nodes, size_t *n) {
  (void)g; (void)nodes; *n = (size_t)captured_launches; return OK;
}
hipError_t hipGraphInstantiateWithFlags(void **e, void *g, unsigned long long f) {
  (void)g; (void)f; *e = &graph_exec_token; return OK;
}
hipError_t hipGraphLaunch(void *e, void *s) { (void)e; (void)s; return OK; }
hipError_t hipGraphExecDestroy(void *e) { (void)e; return OK; }
hipError_t hipGraphDestroy(void *g) { (void)g; return OK; }
