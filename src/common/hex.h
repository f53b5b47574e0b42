/* Hexadecimal digits, shared by the fingerprint, shard and seed code. */
#ifndef KVS_COMMON_HEX_H
#define KVS_COMMON_HEX_H

/* Value of one hex digit (either case), or -1 if c is not one. */
static inline int kvs_hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

#endif
