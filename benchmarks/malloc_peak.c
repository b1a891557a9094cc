/* Host-memory accounting for benchmarks/layer_memory.py: an LD_PRELOAD interposer of the C allocation functions
 * that keeps the bytes of the live blocks of at least 64 KiB (their malloc_usable_size) and the peak of that sum.
 * torch's CPU allocator takes every tensor storage from posix_memalign and returns it with free, the buffers of
 * inductor's compiled kernels included, so this counts the tensor memory of eager and compiled code alike (a
 * dispatch-mode tracker cannot: compiled kernels bypass the dispatcher). Small blocks (the interpreter's objects)
 * are left out. Read from Python with ctypes: memtrack_current(), memtrack_peak(), memtrack_reset_peak(). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

#define BIG 65536
static _Atomic long long cur = 0, peak = 0;
static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void *(*real_memalign)(size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);
/* dlsym may call calloc before real_calloc is known: it gets zeroed static memory, never freed to libc */
static char boot[4096];
static int booting = 0;

static void add(long long n) {
    long long c = atomic_fetch_add(&cur, n) + n;
    long long p = atomic_load(&peak);
    while (c > p && !atomic_compare_exchange_weak(&peak, &p, c)) {
    }
}
static void *counted(void *p) {
    if (p) {
        size_t n = malloc_usable_size(p);
        if (n >= BIG) add((long long)n);
    }
    return p;
}
static void uncount(void *p) {
    if (p) {
        size_t n = malloc_usable_size(p);
        if (n >= BIG) add(-(long long)n);
    }
}
#define RESOLVE(f) do { if (!real_##f) real_##f = dlsym(RTLD_NEXT, #f); } while (0)

void *malloc(size_t size) { RESOLVE(malloc); return counted(real_malloc(size)); }
void *calloc(size_t a, size_t b) {
    if (!real_calloc) {
        if (booting) return boot;
        booting = 1;
        real_calloc = dlsym(RTLD_NEXT, "calloc");
        booting = 0;
    }
    return counted(real_calloc(a, b));
}
void *realloc(void *q, size_t size) {
    RESOLVE(realloc);
    if (q == (void *)boot) return NULL;
    uncount(q);
    void *p = real_realloc(q, size);
    if (!p && q && size) { counted(q); return NULL; } /* failed: q is still live */
    return counted(p);
}
void *memalign(size_t align, size_t size) { RESOLVE(memalign); return counted(real_memalign(align, size)); }
void *aligned_alloc(size_t align, size_t size) {
    RESOLVE(aligned_alloc);
    return counted(real_aligned_alloc(align, size));
}
int posix_memalign(void **out, size_t align, size_t size) {
    RESOLVE(posix_memalign);
    int r = real_posix_memalign(out, align, size);
    if (!r) counted(*out);
    return r;
}
void free(void *p) {
    if (p == (void *)boot) return;
    RESOLVE(free);
    uncount(p);
    real_free(p);
}

long long memtrack_current(void) { return atomic_load(&cur); }
long long memtrack_peak(void) { return atomic_load(&peak); }
long long memtrack_reset_peak(void) {
    long long c = atomic_load(&cur);
    atomic_store(&peak, c);
    return c;
}
