# Embeds a text file as a NUL-terminated C char array (cmake -DIN=file -DOUT=header -DNAME=symbol -P embed.cmake).
file(READ ${IN} _hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," _bytes "${_hex}")
file(WRITE ${OUT} "/* generated from ${IN}: do not edit */\nstatic const char ${NAME}[] = {${_bytes}0x00};\n")
