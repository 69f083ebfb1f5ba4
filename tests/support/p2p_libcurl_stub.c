/* A stand-in libcurl.so.4 for loading mooncake's engine.so on a machine without libcurl
 * (tests/support/p2p_kit.sh builds it only then). mooncake calls libcurl only for an HTTP metadata
 * server; checkpoint-engine's P2P handshake never does. Every entry point reports failure.
 * Build: cc -shared -fPIC -Wl,--version-script=VERSIONS -Wl,-soname,libcurl.so.4 -o libcurl.so.4
 * with VERSIONS = "CURL_OPENSSL_4 { global: curl_*; local: *; };" (the version mooncake's
 * wheel links against). */
#include <stddef.h>

void *curl_easy_init(void) { return NULL; }
void curl_easy_cleanup(void *h) { (void)h; }
void curl_easy_reset(void *h) { (void)h; }
int curl_easy_setopt(void *h, int opt, ...) { (void)h; (void)opt; return 2; }
int curl_easy_perform(void *h) { (void)h; return 2; }
int curl_easy_getinfo(void *h, int info, ...) { (void)h; (void)info; return 2; }
const char *curl_easy_strerror(int code) { (void)code; return "libcurl is not installed"; }
char *curl_easy_escape(void *h, const char *s, int n) { (void)h; (void)s; (void)n; return NULL; }
void curl_free(void *p) { (void)p; }
int curl_global_init(long flags) { (void)flags; return 2; }
void *curl_slist_append(void *list, const char *s) { (void)list; (void)s; return NULL; }
void curl_slist_free_all(void *list) { (void)list; }
