package virtqueue

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// DirtyLog is the front end's dirty-page bitmap for live migration
// (VHOST_USER_PROTOCOL_F_LOG_SHMFD): one bit per 4 KiB guest-physical page,
// bit (page % 8) of byte (page / 8). While the front end has VHOST_F_LOG_ALL
// on, the device sets the bit of every page it writes into: reply and READ
// data in a chain's writable buffers and, for rings that ask for it, the
// used ring. QEMU reads and clears the bitmap as u64 words while the VM
// runs and shares one bitmap among all the VM's vhost-user devices, so the
// device only ever sets bits, with atomic ORs, and sets each one after the
// write it records: a bit set before the write could be read and cleared
// in between, and the write would never be copied.
//
// One DirtyLog belongs to a back end and is shared by its rings. Setting
// bits takes mu shared; Replace takes it exclusively, so once Replace
// returns no ring still writes into the old bitmap, which the front end
// reads and frees as soon as it is told.
type DirtyLog struct {
	on atomic.Bool // VHOST_F_LOG_ALL acknowledged

	mu      sync.RWMutex
	words   []uint32 // the bitmap as 32-bit words (little endian: bit page%32 of word page/32)
	mapping []byte
	release func([]byte)

	beyond   atomic.Uint64 // pages written beyond the bitmap's end: not logged
	unlogged atomic.Uint64 // writes made with logging on but no bitmap mapped
}

// pageShift is the log's page size: 4 KiB whatever the host's page size.
const pageShift = 12

// Active reports whether writes are to be logged. It is the one branch
// the data path pays while the front end does not migrate.
func (l *DirtyLog) Active() bool { return l.on.Load() }

// SetActive turns logging on or off (VHOST_F_LOG_ALL). Logging may be on
// before a bitmap is mapped: a device started during a migration gets its
// features first and its log last.
func (l *DirtyLog) SetActive(on bool) { l.on.Store(on) }

// Replace installs mapping (nil: none) as the bitmap and returns once no
// writer uses the previous one, whose release then runs. len(mapping) must
// be a multiple of 8: QEMU sizes the log in u64 words.
func (l *DirtyLog) Replace(mapping []byte, release func([]byte)) {
	var words []uint32
	if len(mapping) >= 4 {
		words = unsafe.Slice((*uint32)(unsafe.Pointer(&mapping[0])), len(mapping)/4)
	}
	l.mu.Lock()
	oldMap, oldRelease := l.mapping, l.release
	l.words, l.mapping, l.release = words, mapping, release
	l.mu.Unlock()
	if oldRelease != nil && oldMap != nil {
		oldRelease(oldMap)
	}
}

// Size returns the bitmap's size in bytes (0 when none is mapped).
func (l *DirtyLog) Size() int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return len(l.mapping)
}

// Beyond counts pages written beyond the end of the bitmap (they are not
// logged: the front end sized the log for its guest memory).
func (l *DirtyLog) Beyond() uint64 { return l.beyond.Load() }

// Unlogged counts writes made while logging was on and no bitmap mapped.
func (l *DirtyLog) Unlogged() uint64 { return l.unlogged.Load() }

// Mark logs the guest-physical range [gpa, gpa+n).
func (l *DirtyLog) Mark(gpa, n uint64) {
	if n == 0 {
		return
	}
	l.mu.RLock()
	l.markLocked(gpa, n)
	l.mu.RUnlock()
}

// MarkWritten logs the first n bytes of v's segments: what a reply of used
// length n wrote. Unmapped segments are skipped: the VMM writes those (the
// FS_IO bounce) and logs them itself. Adjacent segments, one per guest page
// in a Linux request, are merged into one range.
func (l *DirtyLog) MarkWritten(v *bufvec.Vec, n uint32) {
	if n == 0 {
		return
	}
	l.mu.RLock()
	var start, end uint64 // the range being merged; empty when start == end
	left := uint64(n)
	for _, s := range v.Segments() {
		if left == 0 {
			break
		}
		c := min(uint64(s.Len), left)
		left -= c
		if !s.Mapped() {
			continue
		}
		if s.GPA != end || start == end {
			l.markLocked(start, end-start)
			start = s.GPA
		}
		end = s.GPA + c
	}
	l.markLocked(start, end-start)
	l.mu.RUnlock()
}

// markLocked sets the bits of the pages [gpa, gpa+n) with mu held shared.
func (l *DirtyLog) markLocked(gpa, n uint64) {
	if n == 0 {
		return
	}
	w := l.words
	if w == nil {
		l.unlogged.Add(1)
		return
	}
	first := gpa >> pageShift
	last := (gpa + n - 1) >> pageShift
	if gpa+n-1 < gpa { // wraps: chains are checked, but be safe
		last = ^uint64(0) >> pageShift
	}
	pages := uint64(len(w)) * 32
	if last >= pages {
		if first >= pages {
			l.beyond.Add(last - first + 1)
			return
		}
		l.beyond.Add(last - pages + 1)
		last = pages - 1
	}
	for p := first; p <= last; {
		word := p >> 5
		lo := p & 31
		hi := min(31, lo+(last-p))
		mask := uint32(0xffffffff) >> (31 - hi + lo) << lo
		if atomic.LoadUint32(&w[word])&mask != mask {
			atomic.OrUint32(&w[word], mask)
		}
		p += hi - lo + 1
	}
}
