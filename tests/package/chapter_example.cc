// A consumer of the chapter's extras (qkv::chapter): the name lookup of
// d2l 11.1, exact match of the chapter's first key.
#include <qkv/chapter.h>

#include <cstdio>

int main() {
  const qkv::KeyValueDatabase db;
  const qkv::LookupResult result = db.exact("Zhang");
  std::printf("%s\n", result.match ? db.records()[*result.match].value.c_str() : "no match");
}
