/* dpar.h promises that dpar_cpu_gemm_backend's text has static storage. An atexit handler registered before the
 * first call runs after the destructors of every static made by that call, so it reads the text after the library
 * has torn down its own objects: the text must still be there (under AddressSanitizer, any use of freed memory
 * fails the run). Exits nonzero with a message when the text has changed or vanished. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpar.h"

static const char *text;
static char copy[512];

static void read_at_exit(void) {
  if (strcmp(text, copy) != 0) {
    fprintf(stderr, "gemm_backend_at_exit: the text changed at exit: \"%s\" (before: \"%s\")\n", text, copy);
    _Exit(1);
  }
  printf("at exit: %s\n", text);
}

int main(void) {
  if (atexit(read_at_exit) != 0) {
    fprintf(stderr, "gemm_backend_at_exit: atexit failed\n");
    return 1;
  }
  text = dpar_cpu_gemm_backend();
  if (text == NULL || text[0] == '\0' || strlen(text) >= sizeof copy) {
    fprintf(stderr, "gemm_backend_at_exit: no text, or an unexpectedly long one\n");
    return 1;
  }
  strcpy(copy, text);
  return 0;
}
