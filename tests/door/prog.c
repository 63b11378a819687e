/* A C program reaching the fake driver the three ways (linked, dlsym, cuGetProcAddress), with
 * a budget made through the door's own functions: no Python. Prints one line per step. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef unsigned long long P;
int cuMemAlloc_v2(P *, size_t);
int cuMemFree_v2(P);
int cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
int main(void) {
    void *(*account)(const char *, long long, void *) = dlsym(RTLD_DEFAULT, "gbd_account_new");
    void (*set_current)(void *) = dlsym(RTLD_DEFAULT, "gbd_set_current");
    void (*numbers)(void *, long long *) = dlsym(RTLD_DEFAULT, "gbd_account_numbers");
    if (!account || !set_current || !numbers) { printf("no door\n"); return 3; }
    void *root = account("root", 3000, NULL), *child = account("child", 2000, root);
    set_current(child);
    void *h = dlopen("libcuda.so.1", RTLD_LAZY);
    int (*by_dlsym)(P *, size_t) = (int (*)(P *, size_t))dlsym(h, "cuMemAlloc_v2");
    int (*by_proc)(P *, size_t) = 0;
    cuGetProcAddress_v2("cuMemAlloc", (void **)&by_proc, 12000, 0, 0);
    P a = 0, b = 0, c = 0, d = 0;
    long long n[10];
    int r1 = cuMemAlloc_v2(&a, 600), r2 = by_dlsym(&b, 600), r3 = by_proc(&c, 600);
    numbers(child, n);
    printf("granted %d %d %d held %lld\n", r1, r2, r3, n[0]);
    int r4 = by_proc(&d, 600); /* 2400 > 2000: the child refuses */
    numbers(child, n);
    printf("refused %d held %lld refusals %lld\n", r4, n[0], n[5]);
    set_current(root);
    int r5 = by_dlsym(&d, 1500); /* 1800 + 1500 > 3000: the root refuses */
    set_current(NULL);
    int r6 = cuMemAlloc_v2(&d, 1500); /* outside every budget: passes */
    numbers(root, n);
    printf("root %d outside %d held %lld\n", r5, r6, n[0]);
    cuMemFree_v2(a); cuMemFree_v2(b); cuMemFree_v2(c); cuMemFree_v2(d);
    numbers(root, n);
    printf("freed held %lld\n", n[0]);
    /* dlsym(RTLD_NEXT, ...) searches after its caller, this program, even through the door's
     * dlsym: the first dlsym after the program is the door's own (the door's forwarding that
     * lost the caller would give the C library's, and another preloaded library looking up
     * its own next definition would find itself) */
    void *next = dlsym(RTLD_NEXT, "dlsym");
    Dl_info info;
    printf("next dlsym in %s\n", dladdr(next, &info) && strstr(info.dli_fname, "door") ? "door"
                                                                                        : "other");
    return 0;
}
