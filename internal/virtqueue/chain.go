package virtqueue

import (
	"errors"
	"fmt"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// regionSplits is how many extra segments a chain may use for buffers that
// straddle region boundaries, beyond one segment per descriptor.
const regionSplits = 64

// DescChain is one popped request: the Token to push it back with and its
// device-readable and device-writable buffers as guest memory segments. A
// DescChain is allocated once per consumer of a ring and reused for every
// chain it pops.
type DescChain struct {
	Token    Token
	Readable *bufvec.Vec
	Writable *bufvec.Vec

	size uint16 // ring size the chain was built for
	// allowUnmapped keeps buffers outside guest memory as unmapped
	// segments instead of refusing the chain (the bounce path is usable).
	allowUnmapped bool
	mem           *GuestMemory // translation table for this chain's buffers
	scratch       []byte       // copy of an indirect table that straddles regions
	sawWrite      bool
	byteCount     uint64
}

// NewDescChain returns a chain able to hold any legal chain of a ring with
// size entries.
func NewDescChain(size uint16) *DescChain {
	n := int(size) + regionSplits
	return &DescChain{
		size:     size,
		Readable: bufvec.NewVec(n),
		Writable: bufvec.NewVec(n),
		scratch:  make([]byte, 0, descSize*int(size)),
	}
}

// Cap returns the ring size the chain was built for.
func (c *DescChain) Cap() int { return int(c.size) }

func (c *DescChain) reset(mem *GuestMemory) {
	c.Token = 0
	c.mem = mem
	c.Readable.Reset()
	c.Writable.Reset()
	c.sawWrite = false
	c.byteCount = 0
}

// Release drops the chain's references to guest memory.
func (c *DescChain) Release() {
	c.Readable.Reset()
	c.Writable.Reset()
	c.mem = nil
}

// maxChainBytes bounds the bytes one chain may describe, so sums cannot
// overflow and a request cannot claim more than guest RAM could hold.
const maxChainBytes = 1 << 40

// addBuffer appends the guest buffer [addr, addr+n) to the readable or
// writable side, split into one segment per region it crosses.
func (c *DescChain) addBuffer(addr uint64, n uint32, write bool) error {
	if write {
		c.sawWrite = true
	} else if c.sawWrite {
		return errors.New("readable descriptor after a writable one")
	}
	if n == 0 {
		return nil // carries nothing; harmless
	}
	if addr+uint64(n) < addr {
		return fmt.Errorf("buffer %#x+%#x wraps", addr, n)
	}
	c.byteCount += uint64(n)
	if c.byteCount > maxChainBytes {
		return errors.New("chain describes too many bytes")
	}
	v := c.Readable
	if write {
		v = c.Writable
	}
	for left := uint64(n); left > 0; {
		b, ok := c.mem.Next(addr, left)
		if !ok {
			if !c.allowUnmapped {
				return fmt.Errorf("buffer %#x+%#x outside guest memory", addr, left)
			}
			// Memory the daemon cannot map (a DAX window): kept as an
			// unmapped segment for the bounce through the VMM, which
			// checks the address itself.
			gap := c.mem.Gap(addr, left)
			if err := v.Append(bufvec.Segment{GPA: addr, Len: uint32(gap)}); err != nil {
				return err
			}
			addr += gap
			left -= gap
			continue
		}
		if err := v.Append(bufvec.Segment{Buf: b, GPA: addr, Len: uint32(len(b))}); err != nil {
			return err
		}
		addr += uint64(len(b))
		left -= uint64(len(b))
	}
	return nil
}

// indirectTable returns the indirect descriptor table at addr. A table in
// one region is read in place; one that straddles adjacent regions (legal)
// is copied into scratch space.
func (c *DescChain) indirectTable(addr uint64, n uint32) ([]byte, error) {
	if addr%descSize != 0 {
		// Descriptor tables are 16-byte aligned by the spec.
		return nil, fmt.Errorf("indirect table %#x misaligned", addr)
	}
	if b, ok := c.mem.Slice(addr, uint64(n)); ok {
		return b, nil
	}
	if int(n) > cap(c.scratch) {
		return nil, fmt.Errorf("indirect table of %d bytes too large", n)
	}
	t := c.scratch[:0]
	for left := uint64(n); left > 0; {
		b, ok := c.mem.Next(addr, left)
		if !ok {
			return nil, fmt.Errorf("indirect table %#x+%#x outside guest memory", addr, left)
		}
		t = append(t, b...)
		addr += uint64(len(b))
		left -= uint64(len(b))
	}
	return t, nil
}
