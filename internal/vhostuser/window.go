package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The DAX window (DESIGN §13).
//
// Why it exists: with QEMU ≥ 11.1 a vhost-user back end may offer
// shared-memory regions (protocol feature SHMEM, GET_SHMEM_CONFIG) that the
// VMM puts in a PCI BAR of the device, and may ask the VMM to map a file's
// pages there (SHMEM_MAP / SHMEM_UNMAP on the back-end channel). The guest's
// virtio-fs driver uses region 0 as its DAX cache: FUSE_SETUPMAPPING and
// FUSE_REMOVEMAPPING, served by the file system, become Map and Unmap. The
// VMM keeps the real mappings; the Window keeps a record of them so that a
// new mapping over a range replaces what was there (QEMU refuses
// overlapping maps) and an unmap names each mapping's exact offset and
// length (QEMU refuses anything else).
//
// Concurrency: Map, Unmap and UnmapAll run on request servers, one at a
// time (ops), and wait for the VMM's answer on the back-end channel, which
// they share with the FS_IO bounce (BackendChannel.call: one request
// outstanding at a time, replies are untagged). While QEMU handles a map
// it sends ADD_MEM_REG (REM_MEM_REG for an unmap) on the front-end channel
// and waits for our ack before it answers: the message loop must be free
// to serve it, so it never takes ops. What the message loop does touch
// (forget on RESET_DEVICE, a new back-end channel, disconnect) takes only
// mu, which is never held across a wait. A ring stop (GET_VRING_BASE)
// cancels a waiting request as it cancels FS_IO (runner.stop): QEMU's main
// loop, which would answer, is waiting for our GET_VRING_BASE reply.

// Back-end requests of the window (back end → front end).
const (
	backendReqShmemMap   = 9
	backendReqShmemUnmap = 10

	shmemMsgSize    = 40 // {u8 shmid; u8 pad[7]; u64 fd_offset, shm_offset, len, flags}
	shmemMapWrite   = 1  // flags bit 0: the mapping is writable
	shmemConfigSize = 4 + 4 + 8*256

	windowPage = 4096
	// windowSlot is the guest's DAX slot size (FUSE_DAX_SHIFT 21): the
	// record cap is two records per slot.
	windowSlot = 2 << 20
	// minCacheSize and maxCacheSize bound --cache-size. Every mapping
	// becomes a vhost-user memory region: the guest maps whole 2 MiB
	// slots, 256 at most in 512 MiB, which with the RAM regions fits the
	// 509 memory slots announced (and QEMU's 512).
	minCacheSize = 2 << 20
	maxCacheSize = 512 << 20

	// mapReplyWait bounds the wait for the VMM's answer to a map or
	// unmap (the VMM updates its memory table and our ack of it comes
	// first): a VMM that never answers fails the request, not the ring.
	mapReplyWait = 30 * time.Second
	// mapRegionWait bounds how long a map answered 0 waits for the memory
	// region of the mapping (regionAdded).
	mapRegionWait = 2 * time.Second
)

// CheckCacheSize reports whether size is a valid window size: a power of
// two, at least 2 MiB (the guest maps in 2 MiB slots and QEMU needs a
// power of two) and at most 512 MiB (the memory slots).
func CheckCacheSize(size uint64) error {
	switch {
	case size&(size-1) != 0:
		return fmt.Errorf("cache size %d is not a power of two", size)
	case size < minCacheSize:
		return fmt.Errorf("cache size %d is below 2 MiB", size)
	case size > maxCacheSize:
		return fmt.Errorf("cache size %d is above 512 MiB (every 2 MiB mapping takes a vhost-user memory slot)", size)
	}
	return nil
}

// Window is the DAX window: shared-memory region 0, of Config.CacheSize
// bytes. Its methods are safe for concurrent use.
type Window struct {
	b      *Backend
	size   uint64
	max    int           // most live records (init)
	usable atomic.Bool   // SHMEM, BACKEND_REQ and REPLY_ACK negotiated
	wait   time.Duration // mapReplyWait; tests shorten it

	ops sync.Mutex // one Map, Unmap or UnmapAll at a time; held across waits

	mu   sync.Mutex // guards maps, gen and the region fields; never held across a wait
	maps []mapping  // live mappings, sorted by offset, disjoint
	gen  uint64     // bumped by forget: results of older requests are dropped

	// Memory regions the front end added (ADD_MEM_REG, SET_MEM_TABLE):
	// addSeq counts them, added holds the sizes of the last few, and
	// addedCh is closed (and replaced) at each. Map waits for its region
	// (regionWait).
	addSeq  uint64
	added   [8]uint64
	addedCh chan struct{}
	// regionWait bounds that wait (mapRegionWait; tests shorten it).
	regionWait time.Duration
}

// mapping is the record of one SHMEM_MAP the VMM accepted (or that was
// cancelled after it was sent: the VMM may have done it).
type mapping struct{ off, len uint64 }

func (m mapping) end() uint64 { return m.off + m.len }

func (w *Window) init(b *Backend, size uint64) {
	w.b, w.size, w.wait, w.regionWait = b, size, mapReplyWait, mapRegionWait
	w.addedCh = make(chan struct{})
	// Every mapping becomes a memory region of the table: at most 2 per
	// 2 MiB slot, and never more than the memory slots announced leave
	// beside the RAM regions (a full SET_MEM_TABLE's worth), so that an
	// ADD_MEM_REG of ours is never refused for want of a slot.
	w.max = min(int(2*size/windowSlot), maxMemSlots-maxTableRegions)
}

// Window returns the DAX window, nil without one (Config.CacheSize 0).
func (b *Backend) Window() *Window {
	if b.window.size == 0 {
		return nil
	}
	return &b.window
}

// Size is the window's length in bytes.
func (w *Window) Size() uint64 { return w.size }

// Mappings returns the recorded mappings (offset, length pairs), in order.
func (w *Window) Mappings() [][2]uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([][2]uint64, len(w.maps))
	for i, m := range w.maps {
		out[i] = [2]uint64{m.off, m.len}
	}
	return out
}

// checkRange validates a window range: page multiples, not empty, inside.
func (w *Window) checkRange(off, length uint64) error {
	if length == 0 || off%windowPage != 0 || length%windowPage != 0 || off >= w.size || length > w.size-off {
		return unix.EINVAL
	}
	return nil
}

// Map asks the VMM to map length bytes of fd at fdOffset into the window
// at winOffset (SHMEM_MAP, need_reply). Every existing mapping overlapping
// the range is unmapped first. The fd is only borrowed. Errors are
// unix.Errno: EINVAL bad range, ENOSPC too many live mappings, ENODEV no
// back-end channel or SHMEM not negotiated, EIO the VMM refused or the
// wait was cancelled by a ring stop.
func (w *Window) Map(fd int, fdOffset, winOffset, length uint64, writable bool) error {
	if err := w.checkRange(winOffset, length); err != nil {
		return err
	}
	if fd < 0 || fdOffset%windowPage != 0 || fdOffset > 1<<63-1-length {
		return unix.EINVAL
	}
	if !w.usable.Load() {
		return unix.ENODEV
	}
	w.ops.Lock()
	defer w.ops.Unlock()
	w.mu.Lock()
	gen := w.gen
	lo, hi := w.overlapping(winOffset, winOffset+length)
	victims := append([]mapping(nil), w.maps[lo:hi]...)
	full := len(w.maps)-len(victims)+1 > w.max
	w.mu.Unlock()
	if full {
		return unix.ENOSPC
	}
	for _, v := range victims {
		// A refused unmap means the VMM holds no such mapping: the
		// range is free for ours.
		if _, err := w.unmapOne(v, gen); err != nil {
			return err
		}
	}
	var flags uint64
	if writable {
		flags = shmemMapWrite
	}
	w.mu.Lock()
	seq := w.addSeq
	w.mu.Unlock()
	got, err := w.b.channel.call(backendReqShmemMap, shmemMsg(fdOffset, winOffset, length, flags), fd, w.wait)
	switch {
	case errors.Is(err, errNoChannel):
		return unix.ENODEV
	case err != nil:
		if errors.Is(err, errUnanswered) {
			// Sent, maybe done: keep a record so that the range is
			// unmapped before it is mapped again.
			w.record(mapping{winOffset, length}, gen)
		}
		w.b.log.Warn("DAX map not answered", "window_offset", winOffset, "len", length, "err", err)
		return unix.EIO
	case got != 0:
		w.b.log.Warn("DAX map refused by the VMM", "window_offset", winOffset, "len", length,
			"fd_offset", fdOffset, "writable", writable, "answer", got)
		return unix.EIO
	}
	w.record(mapping{winOffset, length}, gen)
	w.awaitRegion(seq, length, winOffset)
	w.b.log.Debug("DAX map", "window_offset", winOffset, "len", length, "fd_offset", fdOffset, "writable", writable)
	return nil
}

// awaitRegion waits until the front end has added a memory region of
// length bytes since addSeq was seq: QEMU 11.1 answers SHMEM_MAP before
// it sends the ADD_MEM_REG of the mapping (seen on the wire), and a guest
// that uses the mapping as soon as SETUPMAPPING is answered (an O_DIRECT
// read into the DAX page) must find it in the memory table. Bounded, and
// cut short by a ring stop; a region that does not come is logged (the
// mapping works for the guest; only requests with buffers in it fail).
func (w *Window) awaitRegion(seq, length, winOffset uint64) {
	timer := time.NewTimer(w.regionWait)
	defer timer.Stop()
	for {
		w.mu.Lock()
		found := false
		first := seq + 1
		if n := uint64(len(w.added)); w.addSeq >= n && first <= w.addSeq-n {
			first = w.addSeq - n + 1 // older ones are overwritten
		}
		for s := first; s <= w.addSeq; s++ {
			if w.added[s%uint64(len(w.added))] == length {
				found = true
			}
		}
		ch := w.addedCh
		w.mu.Unlock()
		if found || w.b.channel.aborting.Load() > 0 {
			return
		}
		select {
		case <-ch:
		case <-timer.C:
			w.b.log.Warn("DAX map: the VMM sent no memory region for it", "window_offset", winOffset, "len", length,
				"waited", w.regionWait.String())
			return
		}
	}
}

// regionAdded is told by the message loop of each memory region added.
func (w *Window) regionAdded(size uint64) {
	if w.size == 0 {
		return
	}
	w.mu.Lock()
	w.addSeq++
	w.added[w.addSeq%uint64(len(w.added))] = size
	close(w.addedCh)
	w.addedCh = make(chan struct{})
	w.mu.Unlock()
}

// Unmap removes every mapping lying inside [winOffset, winOffset+length)
// (SHMEM_UNMAP of each, with its exact offset and length). A range with no
// mapping is not an error; a mapping that straddles the range's edge is
// EINVAL.
func (w *Window) Unmap(winOffset, length uint64) error {
	if err := w.checkRange(winOffset, length); err != nil {
		return err
	}
	w.ops.Lock()
	defer w.ops.Unlock()
	end := winOffset + length
	w.mu.Lock()
	gen := w.gen
	lo, hi := w.overlapping(winOffset, end)
	victims := append([]mapping(nil), w.maps[lo:hi]...)
	w.mu.Unlock()
	if len(victims) == 0 {
		return nil
	}
	if victims[0].off < winOffset || victims[len(victims)-1].end() > end {
		return unix.EINVAL
	}
	for _, v := range victims {
		refused, err := w.unmapOne(v, gen)
		if err != nil {
			return err
		}
		if refused {
			return unix.EIO
		}
	}
	return nil
}

// UnmapAll sends SHMEM_UNMAP for every recorded mapping, ignores the VMM's
// failures (after a system reset QEMU has already dropped them) and
// forgets them all.
func (w *Window) UnmapAll() {
	w.ops.Lock()
	defer w.ops.Unlock()
	w.mu.Lock()
	victims := w.maps
	w.maps = nil
	w.gen++
	w.mu.Unlock()
	if len(victims) > 0 {
		w.b.log.Debug("DAX unmap all", "count", len(victims))
	}
	for _, v := range victims {
		if !w.usable.Load() {
			return
		}
		_, err := w.b.channel.call(backendReqShmemUnmap, shmemMsg(0, v.off, v.len, 0), -1, w.wait)
		if errors.Is(err, errNoChannel) {
			return
		}
	}
}

// unmapOne sends SHMEM_UNMAP for record v and forgets it unless the
// answer never came (the VMM may still hold it). refused reports a VMM
// that answered with a failure: it holds no such mapping.
func (w *Window) unmapOne(v mapping, gen uint64) (refused bool, err error) {
	if !w.usable.Load() {
		return false, unix.ENODEV
	}
	got, err := w.b.channel.call(backendReqShmemUnmap, shmemMsg(0, v.off, v.len, 0), -1, w.wait)
	switch {
	case errors.Is(err, errNoChannel):
		return false, unix.ENODEV
	case err != nil:
		w.b.log.Warn("DAX unmap not answered", "window_offset", v.off, "len", v.len, "err", err)
		return false, unix.EIO
	}
	w.mu.Lock()
	if w.gen == gen {
		i := sort.Search(len(w.maps), func(i int) bool { return w.maps[i].off >= v.off })
		if i < len(w.maps) && w.maps[i] == v {
			w.maps = append(w.maps[:i], w.maps[i+1:]...)
		}
	}
	w.mu.Unlock()
	if got != 0 {
		// The VMM holds no such mapping: the record was stale.
		w.b.log.Warn("DAX unmap refused by the VMM", "window_offset", v.off, "len", v.len, "answer", got)
		return true, nil
	}
	w.b.log.Debug("DAX unmap", "window_offset", v.off, "len", v.len)
	return false, nil
}

// overlapping returns the index range of the records overlapping
// [off, end). mu is held.
func (w *Window) overlapping(off, end uint64) (lo, hi int) {
	lo = sort.Search(len(w.maps), func(i int) bool { return w.maps[i].end() > off })
	hi = lo
	for hi < len(w.maps) && w.maps[hi].off < end {
		hi++
	}
	return lo, hi
}

// record adds m unless the window was forgotten since gen. Records it
// overlaps are dropped (they were unmapped, or their unmap was refused).
func (w *Window) record(m mapping, gen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.gen != gen {
		return
	}
	lo, hi := w.overlapping(m.off, m.end())
	w.maps = append(w.maps[:lo], append([]mapping{m}, w.maps[hi:]...)...)
}

// forget drops every record without telling the VMM: on RESET_DEVICE, a
// new back-end channel and when the front end goes away. It runs on the
// message loop and never waits for a request in progress.
func (w *Window) forget(why string) {
	if w.size == 0 {
		return
	}
	w.mu.Lock()
	n := len(w.maps)
	w.maps = nil
	w.gen++
	w.mu.Unlock()
	if n > 0 {
		w.b.log.Info("DAX window mappings forgotten", "count", n, "why", why)
	}
}

// shmemMsg encodes the body of SHMEM_MAP and SHMEM_UNMAP for region 0.
func shmemMsg(fdOffset, shmOffset, length, flags uint64) []byte {
	p := make([]byte, shmemMsgSize)
	binary.LittleEndian.PutUint64(p[8:], fdOffset)
	binary.LittleEndian.PutUint64(p[16:], shmOffset)
	binary.LittleEndian.PutUint64(p[24:], length)
	binary.LittleEndian.PutUint64(p[32:], flags)
	return p
}
