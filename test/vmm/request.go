package vmm

import (
	"errors"
	"fmt"
	"time"
)

// FuseRequest is one FUSE request as Linux's virtio_fs driver
// (virtio_fs_enqueue_req) lays it out in a chain:
//
//	readable: fuse_in_header (40 B) | in args (one segment) | in pages (one segment per page)
//	writable: fuse_out_header (16 B) | out args (one segment) | out pages (one segment per page)
//
// Each part is a separate guest buffer, as in the kernel (the headers live
// in struct fuse_req, the arguments in a kmalloc'ed argbuf, the data in
// page-cache or user pages). The exception is FORGET on the hiprio ring:
// one 48-byte buffer holding header and fuse_forget_in (Packed).
type FuseRequest struct {
	In         []byte       // fuse_in_header followed by the op's arguments
	InPages    []byte       // data after the arguments (WRITE), split at page boundaries
	OutArgs    int          // reply argument bytes after fuse_out_header (one segment)
	OutPages   int          // reply data bytes (READ, READDIR), split at page boundaries
	PageOffset int          // offset of the data in its first page (O_DIRECT user buffers)
	NoReply    bool         // FORGET: no writable part at all
	Packed     bool         // header and arguments in one segment (Linux's hiprio FORGET)
	Indirect   IndirectMode // how to submit the chain
	// DataRegions places data page i in region DataRegions[i%len] (for
	// pages the back end cannot map: a DAX window, the FS_IO bounce);
	// empty: the queue's BufRegion.
	DataRegions []int
}

// FuseCall is a FuseRequest in flight.
type FuseCall struct {
	*Chain
	q      *Queue
	bufs   []uint64  // guest allocations to free
	out    []Segment // writable segments, in order
	outCap uint32
}

// Segments lays out the request in freshly allocated guest buffers (from
// the queue's BufRegion) and returns the chain's segments and the
// allocations to free.
func (q *Queue) fuseSegments(r FuseRequest) (segs []Segment, bufs []uint64, err error) {
	region := q.bufRegion()
	alloc := func(b []byte, n int, align uint64, write bool) (uint64, error) {
		gpa, err := q.mem.AllocIn(region, uint64(n), align)
		if err != nil {
			return 0, err
		}
		bufs = append(bufs, gpa)
		if b != nil {
			if err := q.mem.WriteAt(b[:n], gpa); err != nil {
				return 0, err
			}
		}
		segs = append(segs, Segment{Addr: gpa, Len: uint32(n), Write: write})
		return gpa, nil
	}
	pages := func(b []byte, n int, write bool) error {
		off := r.PageOffset % PageSize
		for i, done := 0, 0; done < n; i++ {
			k := min(n-done, PageSize-off)
			pr := region
			if len(r.DataRegions) > 0 {
				pr = r.DataRegions[i%len(r.DataRegions)]
			}
			page, err := q.mem.AllocIn(pr, PageSize, PageSize)
			if err != nil {
				return err
			}
			bufs = append(bufs, page)
			if b != nil {
				if err := q.mem.WriteAt(b[done:done+k], page+uint64(off)); err != nil {
					return err
				}
			}
			segs = append(segs, Segment{Addr: page + uint64(off), Len: uint32(k), Write: write})
			done += k
			off = 0
		}
		return nil
	}
	fail := func(err error) ([]Segment, []uint64, error) {
		for _, b := range bufs {
			q.mem.Free(b)
		}
		return nil, nil, err
	}
	if len(r.In) < FuseInHeaderSize {
		return fail(fmt.Errorf("vmm: FUSE request of %d bytes has no header", len(r.In)))
	}
	hdr := FuseInHeaderSize
	if r.Packed {
		hdr = len(r.In)
	}
	if _, err := alloc(r.In, hdr, 8, false); err != nil {
		return fail(err)
	}
	if n := len(r.In) - hdr; n > 0 {
		if _, err := alloc(r.In[hdr:], n, 8, false); err != nil {
			return fail(err)
		}
	}
	if err := pages(r.InPages, len(r.InPages), false); err != nil {
		return fail(err)
	}
	if !r.NoReply {
		if _, err := alloc(nil, FuseOutHeaderSize, 8, true); err != nil {
			return fail(err)
		}
		if r.OutArgs > 0 {
			if _, err := alloc(nil, r.OutArgs, 8, true); err != nil {
				return fail(err)
			}
		}
		if err := pages(nil, r.OutPages, true); err != nil {
			return fail(err)
		}
	}
	return segs, bufs, nil
}

// AddFuse lays out r in guest memory and makes it available, without
// notifying the device (see Queue.Notify).
func (q *Queue) AddFuse(r FuseRequest) (*FuseCall, error) {
	segs, bufs, err := q.fuseSegments(r)
	if err != nil {
		return nil, err
	}
	c, err := q.Add(segs, r.Indirect)
	if err != nil {
		for _, b := range bufs {
			q.mem.Free(b)
		}
		return nil, err
	}
	return q.newFuseCall(c, segs, bufs), nil
}

// newFuseCall tracks chain c over segs, which live in bufs.
func (q *Queue) newFuseCall(c *Chain, segs []Segment, bufs []uint64) *FuseCall {
	fc := &FuseCall{Chain: c, q: q, bufs: bufs}
	for _, s := range segs {
		if s.Write {
			fc.out = append(fc.out, s)
			fc.outCap += s.Len
		}
	}
	return fc
}

// SubmitFuse is AddFuse followed by Notify.
func (q *Queue) SubmitFuse(r FuseRequest) (*FuseCall, error) {
	fc, err := q.AddFuse(r)
	if err != nil {
		return nil, err
	}
	_, err = q.Notify()
	return fc, err
}

// Writable returns the request's writable segments, in order: where the
// device may write its reply (the dirty-log tests check which it did).
func (f *FuseCall) Writable() []Segment { return f.out }

// ErrUsedLen reports a used length larger than the writable part.
var ErrUsedLen = errors.New("vmm: used length exceeds the writable buffers")

// Wait waits for the device to return the request, then returns the bytes
// it wrote (the writable segments gathered, cut to the used length) and
// frees the guest buffers. If the request is abandoned or times out, the
// buffers stay allocated (the device may still write them).
func (f *FuseCall) Wait(timeout time.Duration) ([]byte, error) {
	n, err := f.Chain.Wait(timeout)
	if err != nil {
		return nil, err
	}
	defer f.release()
	if n > f.outCap {
		return nil, fmt.Errorf("%w: ring %d head %d: used len %d, writable %d", ErrUsedLen, f.q.Index, f.Head, n, f.outCap)
	}
	reply := make([]byte, 0, n)
	for _, s := range f.out {
		if uint32(len(reply)) == n {
			break
		}
		k := min(s.Len, n-uint32(len(reply)))
		b := make([]byte, k)
		if err := f.q.mem.ReadAt(b, s.Addr); err != nil {
			return nil, err
		}
		reply = append(reply, b...)
	}
	return reply, nil
}

func (f *FuseCall) release() {
	for _, b := range f.bufs {
		f.q.mem.Free(b)
	}
	f.bufs = nil
}
