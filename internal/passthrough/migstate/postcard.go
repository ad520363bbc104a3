package migstate

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"unicode/utf8"
)

// The subset of postcard 1.x (the serde format the Rust virtiofsd writes its
// migration state in) that the state needs, as the postcard crate encodes
// and decodes it:
//
//   - u16, u32, u64 and usize (lengths): unsigned LEB128 varints, 7 bits per
//     byte, low group first, bit 7 set on every byte but the last; at most
//     3, 5 and 10 bytes, and the last byte of a maximal one may only hold the
//     bits left (u64: 1 bit, so ≤ 0x01; u32: ≤ 0x0f). A varint padded with
//     0x80 bytes within that maximum is accepted, as postcard accepts it.
//   - i32: zigzag ((n << 1) ^ (n >> 31)), then as u32.
//   - bool: one byte, 0 or 1; Option: one byte, 0 (None) or 1 then the
//     value; anything else is an error.
//   - String and Vec<u8>: a usize length, then the bytes (a String must be
//     UTF-8); Vec<T> and HashMap: a usize count, then the elements (a map's
//     as key, value); structs: their fields in order, nothing else; enums:
//     the variant index as a u32 varint, then the variant's fields.
//
// Every length and count is checked against a caller's bound before
// anything is allocated for it.

var errBadVarint = errors.New("malformed varint")

// pcReader reads a stream: postcard values and the fixed-width
// little-endian fields of our trailer. It counts the bytes, refuses to read
// beyond limit, keeps a CRC-32C of everything read, and keeps the first
// error (later reads return zero values).
type pcReader struct {
	r     *bufio.Reader
	n     int64 // bytes read
	limit int64
	crc   uint32
	err   error
	b     [8]byte
}

func newPCReader(r io.Reader, limit int64) *pcReader {
	return &pcReader{r: bufio.NewReaderSize(r, 64<<10), limit: limit}
}

// fail records err (the first one wins) with the stream position.
func (d *pcReader) fail(what string, err error) {
	if d.err == nil {
		d.err = fmt.Errorf("%s (after %d bytes): %w", what, d.n, err)
	}
}

// read fills p; what names the value for errors. After an error p is
// zeros, so no value read after it is left over from an earlier one.
func (d *pcReader) read(p []byte, what string) {
	if d.err != nil {
		clear(p)
		return
	}
	if d.n+int64(len(p)) > d.limit {
		d.fail(what, fmt.Errorf("%w: more than %d bytes", errTooLarge, d.limit))
		clear(p)
		return
	}
	k, err := io.ReadFull(d.r, p)
	d.crc = crc32.Update(d.crc, castagnoli, p[:k])
	d.n += int64(k)
	switch {
	case err == io.EOF || err == io.ErrUnexpectedEOF:
		d.fail(what, errTruncated)
	case err != nil:
		d.fail(what, err)
	}
	if d.err != nil {
		clear(p)
	}
}

var errTruncated = errors.New("the stream ends here")

func (d *pcReader) u8(what string) uint8 {
	d.read(d.b[:1], what)
	return d.b[0]
}

// varint reads an unsigned varint of at most max bytes whose last byte, if
// it is the max-th, holds at most lastMax.
func (d *pcReader) varint(max int, lastMax byte, what string) uint64 {
	var v uint64
	for i := range max {
		c := d.u8(what)
		if d.err != nil {
			return 0
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c&0x80 == 0 {
			if i == max-1 && c > lastMax {
				break
			}
			return v
		}
	}
	d.fail(what, errBadVarint)
	return 0
}

func (d *pcReader) u64(what string) uint64 { return d.varint(10, 0x01, what) }
func (d *pcReader) u32(what string) uint32 { return uint32(d.varint(5, 0x0f, what)) }

// i32 is a zigzag-encoded i32.
func (d *pcReader) i32(what string) int32 {
	z := d.u32(what)
	return int32(z>>1) ^ -int32(z&1)
}

// flag reads a bool or an Option's tag, one byte of 0 or 1; kind names
// it ("bool" or "option") in errors.
func (d *pcReader) flag(what, kind string) bool {
	c := d.u8(what)
	if c > 1 {
		d.fail(what, fmt.Errorf("%s byte %#x", kind, c))
	}
	return c == 1
}

func (d *pcReader) boolean(what string) bool { return d.flag(what, "bool") }
func (d *pcReader) option(what string) bool  { return d.flag(what, "option") }

// count reads a usize count or length and checks it against max before
// the caller allocates anything for it.
func (d *pcReader) count(max int, what string) int {
	n := d.u64(what)
	if d.err == nil && n > uint64(max) {
		d.fail(what, fmt.Errorf("%d (max %d)", n, max))
	}
	if d.err != nil {
		return 0
	}
	return int(n)
}

// bytes reads a Vec<u8> of at most max bytes.
func (d *pcReader) bytes(max int, what string) []byte {
	n := d.count(max, what)
	if d.err != nil {
		return nil
	}
	b := make([]byte, n)
	d.read(b, what)
	return b
}

// str reads a String of at most max bytes, which must be UTF-8.
func (d *pcReader) str(max int, what string) string {
	b := d.bytes(max, what)
	if d.err == nil && !utf8.Valid(b) {
		d.fail(what, errors.New("not UTF-8"))
	}
	return string(b)
}

// le32 reads a fixed-width little-endian u32 (the trailer).
func (d *pcReader) le32(what string) uint32 {
	d.read(d.b[:4], what)
	return binary.LittleEndian.Uint32(d.b[:])
}

func (d *pcReader) le16(what string) uint16 {
	d.read(d.b[:2], what)
	return binary.LittleEndian.Uint16(d.b[:])
}

// atEOF reports whether the stream ends here (without counting a byte
// read to find out into the checksum: there is none).
func (d *pcReader) atEOF() (bool, error) {
	if d.err != nil {
		return false, d.err
	}
	_, err := d.r.Peek(1)
	switch {
	case err == io.EOF:
		return true, nil
	case err != nil:
		return false, fmt.Errorf("read migration state (after %d bytes): %w", d.n, err)
	}
	return false, nil
}

// pcWriter writes postcard values and fixed-width fields, keeping a
// CRC-32C of everything written and the first error.
type pcWriter struct {
	w   *bufio.Writer
	crc uint32
	err error
	b   [10]byte
}

func newPCWriter(w io.Writer) *pcWriter { return &pcWriter{w: bufio.NewWriterSize(w, 64<<10)} }

func (e *pcWriter) raw(p []byte) {
	if e.err != nil {
		return
	}
	e.crc = crc32.Update(e.crc, castagnoli, p)
	_, e.err = e.w.Write(p)
}

func (e *pcWriter) varint(v uint64) {
	n := 0
	for v >= 0x80 {
		e.b[n] = byte(v) | 0x80
		v >>= 7
		n++
	}
	e.b[n] = byte(v)
	e.raw(e.b[:n+1])
}

func (e *pcWriter) u64(v uint64) { e.varint(v) }
func (e *pcWriter) u32(v uint32) { e.varint(uint64(v)) }
func (e *pcWriter) i32(v int32)  { e.varint(uint64(uint32(v<<1) ^ uint32(v>>31))) }

func (e *pcWriter) boolean(v bool) {
	var c byte
	if v {
		c = 1
	}
	e.b[0] = c
	e.raw(e.b[:1])
}

func (e *pcWriter) bytes(p []byte) {
	e.varint(uint64(len(p)))
	e.raw(p)
}

func (e *pcWriter) str(s string) {
	e.varint(uint64(len(s)))
	if e.err != nil {
		return
	}
	e.crc = crc32.Update(e.crc, castagnoli, []byte(s))
	_, e.err = e.w.WriteString(s)
}

func (e *pcWriter) u8(v uint8) {
	e.b[0] = v
	e.raw(e.b[:1])
}

func (e *pcWriter) le16(v uint16) {
	binary.LittleEndian.PutUint16(e.b[:], v)
	e.raw(e.b[:2])
}

func (e *pcWriter) le32(v uint32) {
	binary.LittleEndian.PutUint32(e.b[:], v)
	e.raw(e.b[:4])
}

func (e *pcWriter) flush() error {
	if e.err == nil {
		e.err = e.w.Flush()
	}
	return e.err
}
