package passthrough

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
)

// The passthrough section of a migration stream (format version 1), all
// integers little-endian:
//
//	magic     8 bytes  "GVFSPT\x00\x01"
//	version   u32      1
//	reserved  u32      0
//	ninodes   u32      ≤ maxStateInodes
//	ninodes × inode:
//	    id       u64   node id
//	    nlookup  u64   the guest's lookup count
//	    type     u32   S_IFMT bits
//	    state    u8    0 path follows, 1 unreachable (pathlen 0)
//	    pathlen  u16   ≤ maxStatePath
//	    path     pathlen bytes, relative to the shared directory
//	nhandles  u32      ≤ maxStateHandles
//	nhandles × handle:
//	    id       u64   file handle
//	    inode    u64   node id (1 for the shared directory)
//	    flags    u32   host open flags (no O_CREAT, O_EXCL, O_TRUNC, O_CLOEXEC)
//	    kind     u8    0 file, 1 directory
//	crc       u32      CRC-32C (Castagnoli) of every byte above
//	end of stream
//
// The decoder reads the whole section into records (migState), checking
// every count and length against its bound before allocating for it, and
// fails on a short stream, bytes after the checksum, a checksum mismatch or
// more than maxStateSize bytes; only then are the records validated and
// reopened. The checksum catches a corrupted or mis-framed stream (a bug,
// a wrong pipe), not an attacker: the state comes from the VMM.

const (
	stateMagic   = "GVFSPT\x00\x01"
	stateVersion = 1
	// maxStateSize bounds what LoadState reads.
	maxStateSize = 1 << 30
)

const (
	inodeHasPath     = 0
	inodeUnreachable = 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errStateTooLarge is returned for a stream beyond the size bound.
var errStateTooLarge = errors.New("migration state too large")

type stateEncoder struct {
	w   *bufio.Writer
	crc uint32
	b   [8]byte
	err error
}

func (e *stateEncoder) raw(p []byte) {
	if e.err != nil {
		return
	}
	e.crc = crc32.Update(e.crc, castagnoli, p)
	_, e.err = e.w.Write(p)
}

func (e *stateEncoder) u8(v uint8) { e.b[0] = v; e.raw(e.b[:1]) }
func (e *stateEncoder) u16(v uint16) {
	binary.LittleEndian.PutUint16(e.b[:], v)
	e.raw(e.b[:2])
}
func (e *stateEncoder) u32(v uint32) {
	binary.LittleEndian.PutUint32(e.b[:], v)
	e.raw(e.b[:4])
}
func (e *stateEncoder) u64(v uint64) {
	binary.LittleEndian.PutUint64(e.b[:], v)
	e.raw(e.b[:8])
}

// encodeState writes s in format version 1. It refuses records the decoder
// would refuse, so a source never sends a state no destination can read.
func encodeState(w io.Writer, s *migState) error {
	if len(s.Inodes) > maxStateInodes || len(s.Handles) > maxStateHandles {
		return fmt.Errorf("encode migration state: %d inodes, %d handles (max %d, %d)",
			len(s.Inodes), len(s.Handles), maxStateInodes, maxStateHandles)
	}
	e := &stateEncoder{w: bufio.NewWriterSize(w, 64<<10)}
	e.raw([]byte(stateMagic))
	e.u32(stateVersion)
	e.u32(0)
	e.u32(uint32(len(s.Inodes)))
	for k := range s.Inodes {
		r := &s.Inodes[k]
		if len(r.Path) > maxStatePath {
			return fmt.Errorf("encode migration state: node %#x: path of %d bytes", r.ID, len(r.Path))
		}
		e.u64(r.ID)
		e.u64(r.Nlookup)
		e.u32(r.Type)
		if r.Unreachable {
			e.u8(inodeUnreachable)
			e.u16(0)
			continue
		}
		e.u8(inodeHasPath)
		e.u16(uint16(len(r.Path)))
		if e.err == nil {
			e.crc = crc32.Update(e.crc, castagnoli, []byte(r.Path))
			_, e.err = e.w.WriteString(r.Path)
		}
	}
	e.u32(uint32(len(s.Handles)))
	for k := range s.Handles {
		h := &s.Handles[k]
		e.u64(h.ID)
		e.u64(h.Inode)
		e.u32(h.Flags)
		var kind uint8
		if h.Dir {
			kind = 1
		}
		e.u8(kind)
	}
	crc := e.crc
	e.u32(crc)
	if e.err == nil {
		e.err = e.w.Flush()
	}
	if e.err != nil {
		return fmt.Errorf("write migration state: %w", e.err)
	}
	return nil
}

type stateDecoder struct {
	r     *bufio.Reader
	crc   uint32
	n     int64 // bytes read
	limit int64
	b     [8]byte
	err   error
}

// read fills p, failing on a short stream or one beyond the limit.
func (d *stateDecoder) read(p []byte, what string) {
	if d.err != nil {
		return
	}
	if d.n+int64(len(p)) > d.limit {
		d.err = fmt.Errorf("%w: more than %d bytes", errStateTooLarge, d.limit)
		return
	}
	n, err := io.ReadFull(d.r, p)
	d.n += int64(n)
	switch {
	case err == io.EOF || err == io.ErrUnexpectedEOF:
		d.err = fmt.Errorf("truncated migration state: it ends in %s (after %d bytes)", what, d.n)
		return
	case err != nil:
		d.err = fmt.Errorf("read migration state (%s, after %d bytes): %w", what, d.n, err)
		return
	}
	d.crc = crc32.Update(d.crc, castagnoli, p)
}

func (d *stateDecoder) u8(what string) uint8 {
	d.read(d.b[:1], what)
	return d.b[0]
}
func (d *stateDecoder) u16(what string) uint16 {
	d.read(d.b[:2], what)
	return binary.LittleEndian.Uint16(d.b[:])
}
func (d *stateDecoder) u32(what string) uint32 {
	d.read(d.b[:4], what)
	return binary.LittleEndian.Uint32(d.b[:])
}
func (d *stateDecoder) u64(what string) uint64 {
	d.read(d.b[:8], what)
	return binary.LittleEndian.Uint64(d.b[:])
}

// decodeState reads a whole passthrough section from r, to end of stream,
// reading at most limit bytes. The records it returns are not validated.
func decodeState(r io.Reader, limit int64) (*migState, error) {
	d := &stateDecoder{r: bufio.NewReaderSize(r, 64<<10), limit: limit}
	var magic [len(stateMagic)]byte
	d.read(magic[:], "the magic")
	if d.err != nil {
		return nil, d.err
	}
	if string(magic[:]) != stateMagic {
		return nil, fmt.Errorf("not a passthrough migration state (magic %q)", magic[:])
	}
	if v := d.u32("the version"); d.err == nil && v != stateVersion {
		return nil, fmt.Errorf("passthrough migration state version %d is not supported (this daemon reads %d)", v, stateVersion)
	}
	if res := d.u32("the header"); d.err == nil && res != 0 {
		return nil, fmt.Errorf("passthrough migration state: reserved header field %#x is not 0", res)
	}
	n := d.u32("the inode count")
	if d.err != nil {
		return nil, d.err
	}
	if n > maxStateInodes {
		return nil, fmt.Errorf("passthrough migration state: %d inodes (max %d)", n, maxStateInodes)
	}
	// Grow with what the stream really holds, not with what it claims.
	s := &migState{Inodes: make([]inodeRecord, 0, min(n, 4096))}
	var path [maxStatePath]byte
	for k := uint32(0); k < n && d.err == nil; k++ {
		r := inodeRecord{
			ID:      d.u64("an inode"),
			Nlookup: d.u64("an inode"),
			Type:    d.u32("an inode"),
		}
		st := d.u8("an inode")
		plen := d.u16("an inode")
		if d.err != nil {
			break
		}
		switch {
		case st > inodeUnreachable:
			return nil, fmt.Errorf("passthrough migration state: inode %d: bad state %d", k, st)
		case plen > maxStatePath:
			return nil, fmt.Errorf("passthrough migration state: inode %d: path of %d bytes (max %d)", k, plen, maxStatePath)
		case st == inodeUnreachable && plen != 0:
			return nil, fmt.Errorf("passthrough migration state: inode %d: unreachable with a path", k)
		}
		r.Unreachable = st == inodeUnreachable
		d.read(path[:plen], "a path")
		r.Path = string(path[:plen])
		s.Inodes = append(s.Inodes, r)
	}
	n = d.u32("the handle count")
	if d.err != nil {
		return nil, d.err
	}
	if n > maxStateHandles {
		return nil, fmt.Errorf("passthrough migration state: %d handles (max %d)", n, maxStateHandles)
	}
	s.Handles = make([]handleRecord, 0, min(n, 4096))
	for k := uint32(0); k < n && d.err == nil; k++ {
		h := handleRecord{ID: d.u64("a handle"), Inode: d.u64("a handle"), Flags: d.u32("a handle")}
		kind := d.u8("a handle")
		if d.err != nil {
			break
		}
		if kind > 1 {
			return nil, fmt.Errorf("passthrough migration state: handle %d: bad kind %d", k, kind)
		}
		h.Dir = kind == 1
		s.Handles = append(s.Handles, h)
	}
	sum := d.crc
	got := d.u32("the checksum")
	if d.err != nil {
		return nil, d.err
	}
	if got != sum {
		return nil, fmt.Errorf("passthrough migration state: checksum %#08x, computed %#08x", got, sum)
	}
	// Nothing may follow (a longer stream is another format, or two).
	var one [1]byte
	switch m, err := io.ReadFull(d.r, one[:]); {
	case m > 0:
		return nil, fmt.Errorf("passthrough migration state: trailing bytes after %d bytes", d.n)
	case err != io.EOF:
		return nil, fmt.Errorf("read migration state (its end, after %d bytes): %w", d.n, err)
	}
	return s, nil
}
