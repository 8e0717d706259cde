/* A libcuda.so.1 for a host without a GPU or NVIDIA driver, for bench/ucx_leak.py only.
 *
 * NIXL wheels before 1.x (nixl-cu12 0.8.0, the last to bundle UCX 1.20 without NIXL's own
 * UCX_RCACHE_MAX_UNRELEASED default, ai-dynamo/nixl PR #1210) link their UCX plugin against the driver
 * library, so the plugin does not load where there is none. Every entry point the plugin imports
 * answers as the real driver does on a machine with no device: CUDA_ERROR_NO_DEVICE (100), or
 * CUDA_ERROR_INVALID_VALUE (1) for a pointer query (host memory is not CUDA memory). Built by
 * bench/ucx_leak.py with the machine's C compiler; never shipped in an image. */
int cuInit(unsigned flags) { (void)flags; return 100; }
int cuDriverGetVersion(int *version) { if (version) *version = 0; return 100; }
int cuDeviceGet(int *device, int ordinal) { (void)device; (void)ordinal; return 100; }
int cuCtxGetCurrent(void **ctx) { if (ctx) *ctx = 0; return 0; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return 100; }
int cuCtxPushCurrent_v2(void *ctx) { (void)ctx; return 100; }
int cuCtxPopCurrent_v2(void **ctx) { if (ctx) *ctx = 0; return 100; }
int cuDevicePrimaryCtxRetain(void **ctx, int device) { (void)ctx; (void)device; return 100; }
int cuDevicePrimaryCtxRelease_v2(int device) { (void)device; return 100; }
int cuPointerGetAttributes(unsigned n, void *attrs, void **data, unsigned long long ptr) {
    (void)n; (void)attrs; (void)data; (void)ptr; return 1;
}
int cuGetErrorName(int error, const char **name) { (void)error; if (name) *name = "CUDA_ERROR_NO_DEVICE"; return 0; }
int cuGetErrorString(int error, const char **text) { (void)error; if (text) *text = "no CUDA device (stub)"; return 0; }
