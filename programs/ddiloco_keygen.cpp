// ddiloco_keygen: makes a CURVE key pair for a syncer or a learner.
//
//   ddiloco_keygen NAME      writes NAME.key (public + secret, mode 0600) and NAME.pub (public only)
//   ddiloco_keygen --version
//
// Give the syncer its NAME.key and an allow-list with each learner's id and
// public key; give each learner its own NAME.key and the syncer's NAME.pub.
#include <ddiloco/transport/zmq.hpp>
#include <ddiloco/version.hpp>

#include <cstdio>
#include <string>

int main(int argc, char** argv) try {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::printf("ddiloco_keygen %s\n", DDILOCO_VERSION_STRING);
    return 0;
  }
  if (argc != 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::puts("usage: ddiloco_keygen NAME   (writes NAME.key with the secret key, NAME.pub with the public key)");
    return argc == 2 ? 0 : 2;
  }
  const std::string name = argv[1];
  const auto keys = ddiloco::generate_curve_keys();
  ddiloco::write_key_file(name + ".key", keys);
  ddiloco::write_key_file(name + ".pub", {keys.public_key, ""});
  std::printf("%s.key (secret, keep it private) and %s.pub written; public key: %s\n", name.c_str(), name.c_str(),
              keys.public_key.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_keygen: %s\n", e.what());
  return 1;
}
