#!/usr/bin/env python3
"""Independent transcription of splitmix64-seeded xoshiro256** (Blackman & Vigna),
used to pin the first outputs of k3ref::num::Random. Usage: xoshiro_reference.py SEED COUNT"""
import sys

M = (1 << 64) - 1


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return state, z ^ (z >> 31)


def stream(seed, count):
    s, x = [], seed
    for _ in range(4):
        x, word = splitmix64(x)
        s.append(word)
    for _ in range(count):
        result = (rotl((s[1] * 5) & M, 7) * 9) & M
        t = (s[1] << 17) & M
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        yield result


if __name__ == "__main__":
    for value in stream(int(sys.argv[1]), int(sys.argv[2])):
        print(f"0x{value:016x}ull")
