#include "command_line.h"

int main(int argc, char** argv) { return k3ref::cli::run(argc, argv); }
