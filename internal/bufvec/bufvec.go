// Package bufvec presents the two halves of a virtio-fs request — the
// device-readable buffers the guest filled in and the device-writable buffers
// the reply goes into — as cursors over lists of guest memory segments.
//
// It is the layer between the ring (which only knows descriptors) and the
// FUSE decoder (which only knows bytes): headers are read with cursor copies
// that may straddle segments, and bulk data moves between guest memory and a
// host file descriptor with one pwritev/preadv over the mapped segments, with
// no intermediate copy.
//
// A Segment may be unmapped: it names guest-physical memory the daemon cannot
// access directly (e.g. a DAX window). Copies through the cursor refuse such
// segments with ErrUnmapped; the bounce path through the VMM handles them.
//
// Nothing here allocates after construction: a Vec is sized once for the
// longest chain a queue can carry and reused for every request.
package bufvec

import (
	"errors"
	"fmt"
)

// ErrUnmapped is returned when a copy would touch a segment that is not
// mapped into the daemon.
var ErrUnmapped = errors.New("buffer segment not mapped by the daemon")

// ErrShort is returned when the segments hold fewer bytes than requested.
var ErrShort = errors.New("guest buffer too short")

// Segment is one contiguous run of guest memory.
type Segment struct {
	// Buf is the host view of the run; nil when the run is not mapped.
	Buf []byte
	// GPA is the guest-physical address of the first byte.
	GPA uint64
	// Len is the length in bytes (len(Buf) when mapped).
	Len uint32
}

// Mapped reports whether the daemon can access the segment directly.
func (s *Segment) Mapped() bool { return s.Buf != nil || s.Len == 0 }

// Vec is an ordered list of segments with a cursor. The zero value is an
// empty Vec; NewVec preallocates room for a chain.
type Vec struct {
	segs  []Segment
	total int // sum of segment lengths

	// Cursor: the next byte is segs[seg] at offset off; pos counts bytes
	// consumed from the start.
	seg int
	off int
	pos int

	iov     iovecs  // scratch for vectored I/O, sized at construction
	bouncer Bouncer // moves unmapped segments' data, nil if none
}

// NewVec returns a Vec that can hold up to maxSegs segments without
// allocating.
func NewVec(maxSegs int) *Vec {
	v := &Vec{segs: make([]Segment, 0, maxSegs)}
	v.iov.init(maxSegs)
	return v
}

// Reset empties the Vec, keeping its storage.
func (v *Vec) Reset() {
	clear(v.segs) // drop references to guest memory
	v.segs = v.segs[:0]
	v.total, v.seg, v.off, v.pos = 0, 0, 0, 0
	v.bouncer = nil
}

// Append adds a segment at the end. It fails, rather than grow, when the Vec
// is full: the caller sized it for the longest legal chain.
func (v *Vec) Append(s Segment) error {
	if s.Buf != nil && len(s.Buf) != int(s.Len) {
		return fmt.Errorf("bufvec: segment length %d does not match buffer length %d", s.Len, len(s.Buf))
	}
	if s.Len == 0 {
		return nil // carries nothing, takes no room
	}
	if len(v.segs) == cap(v.segs) {
		return fmt.Errorf("bufvec: more than %d segments", cap(v.segs))
	}
	v.segs = append(v.segs, s)
	v.total += int(s.Len)
	return nil
}

// Segments returns the segment list. The caller must not modify it.
func (v *Vec) Segments() []Segment { return v.segs }

// Cap returns the number of segments the Vec can hold.
func (v *Vec) Cap() int { return cap(v.segs) }

// Size returns the total number of bytes in all segments.
func (v *Vec) Size() int { return v.total }

// Pos returns the number of bytes the cursor has moved past.
func (v *Vec) Pos() int { return v.pos }

// Len returns the number of bytes after the cursor.
func (v *Vec) Len() int { return v.total - v.pos }

// Rewind moves the cursor back to the start.
func (v *Vec) Rewind() { v.seg, v.off, v.pos = 0, 0, 0 }

// Skip advances the cursor by n bytes.
func (v *Vec) Skip(n int) error {
	if n < 0 || n > v.Len() {
		return ErrShort
	}
	v.advance(n)
	return nil
}

// Seek moves the cursor to absolute position pos.
func (v *Vec) Seek(pos int) error {
	if pos < 0 || pos > v.total {
		return ErrShort
	}
	v.Rewind()
	v.advance(pos)
	return nil
}

// Truncate keeps only the first n bytes (the cursor must not be past
// them): the FUSE decoder cuts a request's extensions off its arguments.
func (v *Vec) Truncate(n int) error {
	if n < 0 || n > v.total || n < v.pos {
		return ErrShort
	}
	keep, cum := 0, 0
	for ; keep < len(v.segs) && cum < n; keep++ {
		l := int(v.segs[keep].Len)
		if cum+l > n {
			l = n - cum
			v.segs[keep].Len = uint32(l)
			if v.segs[keep].Buf != nil {
				v.segs[keep].Buf = v.segs[keep].Buf[:l]
			}
		}
		cum += l
	}
	clear(v.segs[keep:]) // drop references to guest memory
	v.segs = v.segs[:keep]
	v.total = n
	return nil
}

func (v *Vec) advance(n int) {
	v.pos += n
	for n > 0 {
		room := int(v.segs[v.seg].Len) - v.off
		if n < room {
			v.off += n
			return
		}
		n -= room
		v.seg++
		v.off = 0
	}
}

// ReadFull copies len(p) bytes from the cursor into p and advances the
// cursor. Nothing is consumed on error.
func (v *Vec) ReadFull(p []byte) error { return v.copyFull(p, false) }

// WriteFull copies p into the segments at the cursor and advances the
// cursor. Nothing is written on error.
func (v *Vec) WriteFull(p []byte) error { return v.copyFull(p, true) }

// copyFull copies between p and the len(p) bytes at the cursor, into the
// segments if toGuest, and advances the cursor. It checks first that the
// bytes are there and mapped, so that it fails having copied nothing.
func (v *Vec) copyFull(p []byte, toGuest bool) error {
	if len(p) > v.Len() {
		return ErrShort
	}
	if err := v.checkMapped(len(p)); err != nil {
		return err
	}
	seg, off := v.seg, v.off
	for n := 0; n < len(p); {
		s := v.segs[seg].Buf[off:]
		var c int
		if toGuest {
			c = copy(s, p[n:])
		} else {
			c = copy(p[n:], s)
		}
		n += c
		off += c
		if off == len(v.segs[seg].Buf) {
			seg++
			off = 0
		}
	}
	v.seg, v.off, v.pos = seg, off, v.pos+len(p) // advanced by len(p)
	return nil
}

// WriteAt copies p to absolute position pos without moving the cursor; it
// is how a reply header is filled in once the reply's length is known.
func (v *Vec) WriteAt(p []byte, pos int) error {
	seg, off, cpos := v.seg, v.off, v.pos
	defer func() { v.seg, v.off, v.pos = seg, off, cpos }()
	if err := v.Seek(pos); err != nil {
		return err
	}
	return v.WriteFull(p)
}

// Zero writes n zero bytes at the cursor and advances it.
func (v *Vec) Zero(n int) error {
	if n < 0 || n > v.Len() {
		return ErrShort
	}
	if err := v.checkMapped(n); err != nil {
		return err
	}
	for n > 0 {
		s := v.segs[v.seg].Buf[v.off:]
		c := min(n, len(s))
		clear(s[:c])
		v.advance(c)
		n -= c
	}
	return nil
}

// checkMapped reports ErrUnmapped if any of the next n bytes lies in an
// unmapped segment.
func (v *Vec) checkMapped(n int) error {
	for i, off := v.seg, v.off; n > 0 && i < len(v.segs); i++ {
		if !v.segs[i].Mapped() {
			return ErrUnmapped
		}
		n -= int(v.segs[i].Len) - off
		off = 0
	}
	return nil
}

// Contiguous returns the next n bytes as one slice of guest memory if they
// lie in a single mapped segment, without moving the cursor. Decoders use it
// to read names in place. n == 0 always succeeds (with an empty slice);
// n < 0 never does.
func (v *Vec) Contiguous(n int) ([]byte, bool) {
	if n < 0 || n > v.Len() {
		return nil, false
	}
	if n == 0 {
		return []byte{}, true
	}
	s := &v.segs[v.seg]
	if !s.Mapped() || v.off+n > len(s.Buf) {
		return nil, false
	}
	return s.Buf[v.off : v.off+n], true
}

// Unmapped reports whether any of the next n bytes after the cursor lies in
// an unmapped segment.
func (v *Vec) Unmapped(n int) bool { return v.checkMapped(min(n, v.Len())) != nil }
